"""The balancing benchmark runs (briefly) and prints its table: a smoke run, not a timing
test. Its figures are read off the full run (docs/fleet.md), never asserted here."""

import json
import subprocess
import sys

from ...support.servers import ROOT


def test_balance_benchmark_smoke():
    res = subprocess.run(
        [sys.executable, "tests/bench/balance_bench.py", "--smoke", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["policy"] for r in out["compare"]] == ["least-loaded", "round-robin"]
    for row in out["compare"]:
        assert row["ok"] == row["requests"] == 24, row
        assert abs(row["share_fast"] + row["share_slow"] - 1) < 1e-9
    # round-robin halves the pool; the kill is seen and costs at most what was in flight
    assert out["compare"][1]["share_fast"] == 0.5
    kill = out["kill"]
    assert kill["eject_ms"] is not None
    assert kill["lost"] <= kill["concurrency"], kill
    rr, prefix = out["affinity"]
    assert prefix["cached_share"] >= rr["cached_share"], out["affinity"]
