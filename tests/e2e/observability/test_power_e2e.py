"""GPU power end to end: the simulator's dcgm-exporter lines read by a real proxy, and a
proxy with no GPU, a hung NVML or a DCGM endpoint that is down.

The simulator integrates each simulated GPU's power exactly and writes every request's
share of it to its truth log; the proxy only sees 50 ms samples of DCGM_FI_DEV_POWER_USAGE
and DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, as it would see a real exporter.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from proxy.services.power import parse_dcgm
from proxy.sim.physics import DEFAULT_MODELS, RTX_4090, power_watts

from ...support.servers import metric_samples, sample, start_proxy, start_sim, stream_chat, wait_for

MODELS = {m.profile.name: m for m in DEFAULT_MODELS}  # precision -> spec; GPU i = model i
GPU = {m.profile.name: str(i) for i, m in enumerate(DEFAULT_MODELS)}
#: Tokens per request so each precision decodes for about 3 s on the simulated RTX 4090.
TOKENS = {"bf16": 150, "fp8": 280, "int4": 470}


def test_simulator_serves_dcgm_exporter_lines(sim):
    t1_sent = time.monotonic()
    text = httpx.get(sim.url + "/metrics").text
    t1_received = time.monotonic()
    assert "vllm:num_requests_running{" in text  # the engine's own lines stay
    assert (
        "# HELP DCGM_FI_DEV_POWER_USAGE Power draw (in W).\n# TYPE DCGM_FI_DEV_POWER_USAGE gauge\n"
    ) in text
    assert (
        "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION Total energy consumption since boot "
        "(in mJ).\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"
    ) in text
    line = next(ln for ln in text.splitlines() if ln.startswith('DCGM_FI_DEV_POWER_USAGE{gpu="2"'))
    assert 'UUID="GPU-' in line and 'device="nvidia2"' in line
    assert 'modelName="NVIDIA GeForce RTX 4090"' in line and line.endswith(" 22.000000")
    first = parse_dcgm(text)
    assert sorted(first) == ["0", "1", "2"]
    time.sleep(0.3)
    t2_sent = time.monotonic()
    later = parse_dcgm(httpx.get(sim.url + "/metrics").text)
    t2_received = time.monotonic()
    # idle: 22 W between the two pages, counted in mJ; the engine read its counter somewhere
    # inside each request, so the interval lies between these bounds whatever the load
    gained = later["2"].energy_mj - first["2"].energy_mj
    assert 22 * (t2_sent - t1_received) * 1000 * 0.99 <= gained
    assert gained <= 22 * (t2_received - t1_sent) * 1000 * 1.01


@pytest.fixture(scope="module")
def powered():
    """A real-time simulator and a proxy reading its power every 50 ms, GPU i -> model i."""
    sim = start_sim("vllm", speed=1.0, jitter=0.0)
    args = [
        "--power-source",
        "dcgm",
        "--power-dcgm-url",
        sim.url + "/metrics",
        "--power-interval",
        "0.05",
    ]
    for p, m in MODELS.items():
        args += ["--power-gpu", f"{GPU[p]}={m.id}"]
    proxy = start_proxy(f"sim={sim.url}", args=args)
    try:
        wait_for(
            lambda: (
                sample(metric_samples(proxy.url), "phasewatch_power_sampling_up", source="dcgm")
                == 1.0
            ),
            what="power sampling",
        )
        yield sim, proxy
    finally:
        proxy.stop()
        sim.stop()


def energy_by_precision(samples) -> dict[str, float]:
    return {
        p: sample(samples, "phasewatch_gpu_energy_joules_total", precision=p, gpu=GPU[p])
        for p in MODELS
    }


def test_joules_per_token_by_precision_match_the_simulator(powered):
    sim, proxy = powered
    before = metric_samples(proxy.url)
    sim_before = parse_dcgm(httpx.get(sim.url + "/metrics").text)
    # Two concurrent streams per precision, all three GPUs busy at once, ~3 s each...
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = [
            pool.submit(stream_chat, proxy.url, m.id, f"power test {p} {i}", TOKENS[p])
            for p, m in MODELS.items()
            for i in range(2)
        ]
        for job in jobs:
            job.result()
    # ...then one 8K-token prompt on bf16: ~2 s of prefill alone on its GPU.
    stream_chat(proxy.url, MODELS["bf16"].id, " ".join(["prefill"] * 8000), 2)
    truth = sim.truth(at_least=7)
    assert len(truth) == 7 and all(t["energy_joules"] > 0 for t in truth)

    def settled():
        # every request's phases observed or counted unresolved, once the sensor covered
        # their ends, and the counter stepped past them
        s = metric_samples(proxy.url)
        done = sum(
            v
            for (name, _), v in s.items()
            if name in ("phasewatch_gpu_power_watts_count", "phasewatch_gpu_power_unresolved_total")
        )
        return s if done >= 14 else None

    after = wait_for(settled, what="every request's power settled")
    time.sleep(0.4)  # several samples past the end, every GPU idle again
    after = metric_samples(proxy.url)
    sim_after = parse_dcgm(httpx.get(sim.url + "/metrics").text)

    e0, e1 = energy_by_precision(before), energy_by_precision(after)
    for p, m in MODELS.items():
        tokens = sample(after, "phasewatch_tokens_total", precision=p, phase="decode") - sample(
            before, "phasewatch_tokens_total", precision=p, phase="decode"
        )
        mine = [t for t in truth if t["model"] == m.id]
        assert tokens == sum(t["completion_tokens"] for t in mine)
        # rate(energy) / rate(tokens): the GPU's energy counter over the window, idle
        # included, against the simulator's own integral over the same window.
        true_j = (sim_after[GPU[p]].energy_mj - sim_before[GPU[p]].energy_mj) / 1000.0
        assert (e1[p] - e0[p]) / tokens == pytest.approx(true_j / tokens, rel=0.02), p
        # The requests' attributed share of the GPU's energy (both phases), against the
        # simulator's exact share, per generated token.
        attributed = sum(
            v
            for (name, lab), v in after.items()
            if name == "phasewatch_request_phase_energy_joules_total"
            and dict(lab).get("precision") == p
        )
        true_jpt = sum(t["energy_joules"] for t in mine) / sum(t["completion_tokens"] for t in mine)
        # (each request is charged from the first sampler tick that saw it to the first
        # that did not: a tick's worth of edge on ~2 s requests)
        assert attributed / tokens == pytest.approx(true_jpt, rel=0.04), p

    # Per-request decode power per precision: the simulator's draw at a batch of two.
    decode = {}
    for p, m in MODELS.items():
        n = sample(after, "phasewatch_gpu_power_watts_count", precision=p, phase="decode")
        assert n >= 2
        decode[p] = sample(after, "phasewatch_gpu_power_watts_sum", precision=p, phase="decode") / n
        assert decode[p] == pytest.approx(power_watts(m, RTX_4090, "decode", 2), rel=0.03), p
    assert decode["bf16"] > decode["fp8"] > decode["int4"]
    # The long prompt's prefill window, alone on its GPU: the one prefill long enough to
    # be resolved (the short prompts' prefills are counted unresolved).
    lab = {"precision": "bf16", "phase": "prefill"}
    assert sample(after, "phasewatch_gpu_power_watts_count", **lab) == 1
    assert sample(after, "phasewatch_gpu_power_watts_sum", **lab) == pytest.approx(
        power_watts(MODELS["bf16"], RTX_4090, "prefill"), rel=0.03
    )
    # Samples by state: idle power and load power both visible, per precision.
    for p in MODELS:
        idle_n = sample(after, "phasewatch_gpu_power_sample_watts_count", precision=p, state="idle")
        idle_w = sample(after, "phasewatch_gpu_power_sample_watts_sum", precision=p, state="idle")
        assert idle_n > 10 and idle_w / idle_n == pytest.approx(RTX_4090.idle_watts, rel=0.05)
        assert (
            sample(after, "phasewatch_gpu_power_sample_watts_count", precision=p, state="decode")
            > 20
        )
    assert (
        sample(after, "phasewatch_gpu_power_sample_watts_count", precision="bf16", state="prefill")
        > 20
    )


def _stub_pynvml(tmp_path, hang: bool):
    """A pynvml first on the path: either no NVML library, or a GPU whose power read hangs."""
    (tmp_path / "pynvml.py").write_text(f"""
import time
class NVMLError(Exception):
    pass
HANG = {hang!r}
def nvmlInit():
    if not HANG:
        raise NVMLError("NVML Shared Library Not Found")
def nvmlDeviceGetCount():
    return 1
def nvmlDeviceGetHandleByIndex(i):
    return i
def nvmlDeviceGetTotalEnergyConsumption(h):
    return 1000
def nvmlDeviceGetPowerUsage(h):
    time.sleep(3600)
def nvmlShutdown():
    pass
""")
    return {"PYTHONPATH": str(tmp_path)}


@pytest.mark.parametrize("case", ["no-nvml", "nvml-hangs", "dcgm-down"])
def test_without_power_the_proxy_relays_measures_and_says_so_once(sim, tmp_path, case):
    if case == "dcgm-down":
        from ...support.servers import free_port

        env, source = None, "dcgm"
        args = [
            "--power-source",
            "dcgm",
            "--power-dcgm-url",
            f"http://127.0.0.1:{free_port()}/metrics",
            "--power-interval",
            "0.05",
        ]
    else:
        env, source, args = _stub_pynvml(tmp_path, hang=case == "nvml-hangs"), "nvml", []
    proxy = start_proxy(f"sim={sim.url}", env=env, args=args)
    try:
        for i in range(2):
            stream_chat(proxy.url, "meta-llama/Llama-3.1-8B-Instruct", f"no power {case} {i}", 8)
        wait_for(lambda: len(proxy.request_lines()) >= 2, what="request lines")
        samples = wait_for(
            lambda: (
                (s := metric_samples(proxy.url))
                and ("phasewatch_power_sampling_up", (("source", source),)) in s
                and s
            ),
            what="sampling_up",
        )
        assert sample(samples, "phasewatch_power_sampling_up", source=source) == 0.0
        # everything else measured...
        assert sample(samples, "phasewatch_requests_total", outcome="ok") >= 2
        assert sample(samples, "phasewatch_decode_tokens_per_second_count") >= 2
        # ...power absent, not zero
        assert not [
            k
            for k in samples
            if k[0].startswith("phasewatch_gpu_") and not k[0].endswith("_created")
        ]
        assert len(proxy.request_lines(at_least=2)) >= 2
        wait_for(lambda: "power is not" in proxy.log(), what="the power log line")
        time.sleep(0.5)  # more failed samples: still said only once
        said = [ln for ln in proxy.log().splitlines() if "power is not" in ln]
        assert len(said) == 1, said
        expected = {
            "no-nvml": "NVML Shared Library Not Found",
            "nvml-hangs": "hung",
            "dcgm-down": "reading dcgm failed",
        }[case]
        assert expected in said[0]
    finally:
        proxy.stop()
    # a hung NVML call does not hold up shutdown: the proxy exits on SIGTERM by itself
    # (uvicorn re-raises the SIGTERM it handled) rather than being killed after the wait
    assert proxy.proc.returncode in (0, -15)
