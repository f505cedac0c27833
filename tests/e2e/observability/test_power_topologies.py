"""Energy that adds up where phasewatch is deployed: replicas sharing one engine, a client
beside phasewatch talking to the engine directly, ``--workers 2`` beside a second replica.

Each replica reads the same GPU (the simulator's ``ampere`` sensor behind a 100 ms DCGM
page, or through the NVML stand-in of tests/support/nvml) and the engine's own count of
running requests, so it charges the requests it relayed with their share of each counter
step and counts the rest as unattributed. Against the simulator's truth (each moment's
draw split evenly among the requests running): each replica's attributed energy is within
15 % of the truth of the requests it relayed, its unattributed energy within 15 % of the
truth of the others, and attributed + unattributed + idle = its GPU counter.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from proxy.sim.physics import DEFAULT_MODELS

from ...support.servers import (
    ROOT,
    metric_samples,
    parse_logfmt,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)

MODEL = DEFAULT_MODELS[0]  # bf16, on simulated GPU 0
NVML = Path(__file__).resolve().parents[2] / "support" / "nvml"
LIMIT = 0.15
#: One request's settled energy against its truth: others' requests are seen from the
#: engine's next count (read every 0.1 s, placed within half a read), so a short
#: request's own figure is looser than a replica's sum
ONE_LIMIT = 0.4
#: (prompt words, answer tokens) of each request a round sends through each way in:
#: lengths differ so the requests overlap by parts, as real traffic does
WAYS = {
    "a": [(3000, 120), (1500, 60)],
    "b": [(2000, 150)],
    "direct": [(2500, 90), (800, 40)],
}
ROUNDS = 2


def chat(url: str, rid: str, words: int, tokens: int, model: str = MODEL.id) -> None:
    """One streamed chat completion read to its end, with its own x-request-id (the
    simulator's truth record carries it)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{rid} " + "w " * words}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-request-id": rid}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_raw():
            pass


def start_replica(sim, path: str, workers: int = 1, model: str = MODEL.id):
    args = ["--power-interval", "0.05", "--power-gpu", f"0={model}"]
    env = None
    if path == "nvml":
        args += ["--power-source", "nvml"]
        env = {
            "PYTHONPATH": os.pathsep.join([str(NVML), os.environ.get("PYTHONPATH", "")]),
            "PHASEWATCH_TEST_NVML_URL": sim.url + "/sim/nvml",
        }
    else:
        args += ["--power-source", "dcgm", "--power-dcgm-url", sim.url + "/metrics"]
    if workers > 1:
        args += ["--workers", str(workers)]
    return start_proxy(f"sim={sim.url}", env=env, args=args)


def settled(url: str, n: int) -> dict | None:
    """The replica's page once each of its `n` requests' phases are settled."""
    s = metric_samples(url)
    done = sample(s, "phasewatch_gpu_power_watts_count") + sample(
        s, "phasewatch_gpu_power_unresolved_total"
    )
    return s if done >= 2 * n else None


def energy_lines(proxy) -> dict[str, dict]:
    """The follow-up energy line of each request, by request id."""
    return {
        f["request_id"]: f
        for line in proxy.log().splitlines()
        if "msg=energy " in line
        for f in [parse_logfmt(line.split("msg=energy ", 1)[1])]
    }


def client_rows(url: str) -> dict[str, list[str]]:
    """``phasewatch report --by client``'s table, by client."""
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", url, "--by", "client"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return {
        cells[0]: cells
        for line in res.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| client")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }


def conservation_error(got: dict[str, float]) -> float:
    return got["attributed"] + got["unattributed"] + got["idle"] - got["counter"]


def ledger(s: dict) -> dict[str, float]:
    return {
        name: sample(s, f"phasewatch_{metric}")
        for name, metric in (
            ("counter", "gpu_energy_joules_total"),
            ("attributed", "request_phase_energy_joules_total"),
            ("by_client", "request_energy_joules_total"),
            ("unattributed", "gpu_unattributed_energy_joules_total"),
            ("idle", "gpu_idle_energy_joules_total"),
        )
    }


def run(path: str, ways: dict[str, str], workers: dict[str, int], engine: str = "vllm") -> None:
    """`ways`: who sends a way's requests -> the URL they go to (a replica's or the
    engine's own); each replica named in `ways` is started with `workers`."""
    sim = start_sim(engine, jitter=0.0, extra=["--gpu-sensor", "ampere", "--dcgm-interval", "0.1"])
    model = (
        MODEL.id if engine == "vllm" else httpx.get(sim.url + "/v1/models").json()["data"][0]["id"]
    )
    replicas = {}
    try:
        for name in ways:
            if name != "direct":
                replicas[name] = start_replica(sim, path, workers.get(name, 1), model)
        for p in replicas.values():
            wait_for(
                lambda p=p: sample(metric_samples(p.url), "phasewatch_gpu_power_sensor_info") >= 1,
                what="the sensor learnt",
            )
        urls = {name: replicas[name].url if name in replicas else sim.url for name in ways}
        sent: dict[str, list[str]] = {name: [] for name in ways}
        jobs = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for r in range(ROUNDS):
                for name in ways:
                    for k, (words, tokens) in enumerate(WAYS[name]):
                        rid = f"{name}-{r}-{k}"
                        sent[name].append(rid)
                        jobs.append(pool.submit(chat, urls[name], rid, words, tokens, model))
            for job in jobs:
                job.result()
        truth = {t["request_id"]: t for t in sim.truth(at_least=len(jobs))}
        pages = {}
        for name, p in replicas.items():
            n = len(sent[name])
            pages[name] = wait_for(lambda p=p, n=n: settled(p.url, n), what="settled")
        # every replica's counter past the traffic: the last step's energy is spread. A
        # page rendered while the sampler publishes a step can hold the step's idle part
        # and not its total: conservation is read from a page that holds a whole step
        for name, p in replicas.items():
            before = ledger(pages[name])["counter"]
            pages[name] = wait_for(
                lambda p=p, before=before: (
                    (s := metric_samples(p.url))
                    and ledger(s)["counter"] > before + 5
                    and abs(conservation_error(ledger(s))) < 0.01
                    and s
                ),
                what="the counter past the traffic, conserved",
            )
        figures = {}
        for name, s in pages.items():
            n = len(sent[name])
            lines = wait_for(
                lambda p=replicas[name], n=n: len(got := energy_lines(p)) >= n and got,
                what="each request's energy line",
            )
            # each relayed request's settled energy, keyed by its id, against its truth
            assert set(lines) == set(sent[name]), (name, sorted(lines))
            per_request = {
                rid: (float(lines[rid]["energy_j"]), truth[rid]["energy_joules"])
                for rid in sent[name]
            }
            got = ledger(s)
            mine = sum(truth[rid]["energy_joules"] for rid in sent[name])
            others = sum(
                truth[rid]["energy_joules"] for n, rids in sent.items() if n != name for rid in rids
            )
            figures[name] = {
                **{k: round(v, 1) for k, v in got.items()},
                "truth_relayed": round(mine, 1),
                "truth_others": round(others, 1),
                "conservation_error": conservation_error(got),
                "lines_joules": round(sum(j for j, _ in per_request.values()), 1),
                "worst_request": round(max(abs(j / t - 1) for j, t in per_request.values()), 3),
            }
        print("FIGURES", json.dumps({"path": path, "ways": sorted(ways), "replicas": figures}))
        for name, f in figures.items():
            assert f["attributed"] == pytest.approx(f["truth_relayed"], rel=LIMIT), (name, f)
            assert f["unattributed"] == pytest.approx(f["truth_others"], rel=LIMIT), (name, f)
            assert f["by_client"] == pytest.approx(f["attributed"], abs=0.01)
            assert abs(f["conservation_error"]) < 0.01, (name, f)
            assert f["lines_joules"] == pytest.approx(f["attributed"], abs=0.1), (name, f)
            assert f["worst_request"] <= ONE_LIMIT, (name, f)
        # the per-client table: the energy and the requests it rests on
        name, p = next(iter(replicas.items()))
        row = client_rows(p.url)["unknown"]
        assert float(row[8]) == pytest.approx(figures[name]["by_client"], abs=0.1), row
        assert row[11] == f"{len(sent[name])} / 0", row
    finally:
        for p in replicas.values():
            p.stop()
        sim.stop()


@pytest.mark.parametrize("path", ["dcgm", "nvml"])
def test_two_replicas_on_one_engine_each_charge_their_own(path):
    run(path, {"a": "replica", "b": "replica"}, {})


@pytest.mark.parametrize("engine", ["vllm", "llamacpp"])
def test_a_replica_beside_a_direct_client_counts_the_client_unattributed(engine):
    run("dcgm", {"a": "replica", "direct": "engine"}, {}, engine)


def test_workers_beside_a_second_replica():
    run("dcgm", {"a": "replica", "b": "replica"}, {"a": 2})


def test_an_engine_with_no_count_is_said_once_and_shown():
    """Ollama gives no count of what it runs: attribution assumes phasewatch relays every
    request, said once in the log and on the status summary; nothing is unattributed."""
    sim = start_sim(
        "ollama", jitter=0.0, extra=["--gpu-sensor", "ampere", "--dcgm-interval", "0.1"]
    )
    model = httpx.get(sim.url + "/api/tags").json()["models"][0]["name"]
    proxy = start_replica(sim, "dcgm", model=model)
    try:
        said = "gives no count of the requests it runs"
        wait_for(lambda: said in proxy.log(), what="the line")
        summary = httpx.get(proxy.url + "/phasewatch/api/summary").json()
        assert [u["energy_counted"] for u in summary["upstreams"]] == [False]
        chat(proxy.url, "o-1", 1500, 60, model)
        wait_for(lambda: "o-1" in energy_lines(proxy), what="the energy line")
        s = metric_samples(proxy.url)
        assert sample(s, "phasewatch_power_engine_count_up") == 0
        assert sample(s, "phasewatch_request_phase_energy_joules_total") > 0
        assert sample(s, "phasewatch_gpu_unattributed_energy_joules_total") == 0
        assert proxy.log().count(said) == 1
    finally:
        proxy.stop()
        sim.stop()
