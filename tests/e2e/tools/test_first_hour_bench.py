"""``phasewatch bench --repeat 1`` says what its figures are (one run each, no median or
spread) in its table and in its charts, and other traffic on the engine is one warning for
the whole bench, carried by the charts too. Through the command line, against the
simulator with another client's streams beside the bench."""

from __future__ import annotations

import subprocess
import sys
import threading

from proxy.tools.bench import table, warnings

from ...support.servers import ROOT, start_sim
from .test_bench_live import INT4, _traffic
from .test_bench_spread import _result


def test_other_traffic_on_several_scenarios_and_models_is_one_warning():
    r = _result((130.0, 131.0, 129.5), {"decode": ["run 1: 3 requests not the bench's"]})
    second = {**r["models"][0], "model": "other-model", "precision": "bf16"}
    second["other_traffic"] = {
        "prefill ~4K": [f"run {i}: 1 more request busy" for i in range(1, 6)],
        "decode": ["run 2: 2 requests not the bench's"],
    }
    r["models"].append(second)
    w = warnings(r, 0.1)
    busy = [x for x in w if "other traffic" in x]
    assert len(busy) == 1, w
    line = busy[0]
    assert "decode runs of hugging-quants" in line and "prefill ~4K runs of other-model" in line
    assert "2 more" in line  # five runs: three shown, the rest counted


def test_one_repetition_is_said_in_the_table():
    r = {**_result((130.0,)), "repetitions": 1}
    out = table(r)
    assert "of 1 runs" not in out and "median (min–max)" not in out
    assert "one run per figure" in out.splitlines()[0]
    assert "| 130.0 |" in out


def test_bench_repeat_1_with_other_traffic_through_the_cli(tmp_path):
    sim = start_sim("vllm", speed=4.0, deterministic=False, jitter=0.01)
    stop = threading.Event()
    t = _traffic(sim.url, INT4, stop)
    plots = tmp_path / "plots"
    try:
        res = subprocess.run(
            [sys.executable, "-m", "proxy", "bench", "--url", sim.url, "--model", INT4]
            + ["--repeat", "1", "--decode-tokens", "96", "--prompt-tokens", "2048"]
            + ["--concurrency", "2", "--idle-seconds", "0", "--plot", str(plots)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop.set()
        t.join(30)
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "of 1 runs" not in out and "median (min–max)" not in out, out
    assert "one run per figure" in out.splitlines()[0], out
    assert "min–max of the runs" not in out
    assert sum("other traffic" in ln for ln in out.splitlines() if ln.startswith("- ⚠")) == 1, out
    assert "of 1 runs" not in res.stderr and "repetition(s)" not in res.stderr
    for name in ("decode", "overview"):
        for ext in ("svg", "png"):
            data = (plots / f"{name}.{ext}").read_bytes()
            assert b"one run per figure" in data, (name, ext)
            assert b"other traffic on the engine" in data, (name, ext)
