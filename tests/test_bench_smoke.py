"""The relay benchmark runs (briefly) and prints its table: a smoke run, not a timing test.

Speed targets are read off the full run's table (README, Benchmarks), never asserted here.
"""

import re
import subprocess
import sys

from .servers import ROOT


def test_relay_benchmark_smoke():
    res = subprocess.run(
        [sys.executable, "tests/bench/relay_bench.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    head = next(line for line in out.splitlines() if line.strip().startswith("metric"))
    for name in ("direct", "plain", "pw×1", "pw×2"):
        assert name in head, head
    for row in (
        "(a) added TTFT p50 ms",
        "(b) c8 events/s",
        "(b) c8 CPU µs/event",
        "(c) paced CPU µs/event",
        "(c) decode tok/s mean",
        "(c) gap p99 ms",
        "(d) peak RSS MiB/proc",
    ):
        assert re.search(re.escape(row) + r"\s+\S", out), (row, out)
    assert "scaling c8:" in out, out
    assert "INCOMPLETE" not in out, out
