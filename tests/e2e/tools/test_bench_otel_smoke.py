"""The relay benchmark's --otel comparison runs (briefly) and prints its table: a smoke run,
not a timing test (the figures are read off a full run, docs/performance.md)."""

import re
import subprocess
import sys

from ...support.servers import ROOT


def test_relay_benchmark_otel_smoke():
    res = subprocess.run(
        [
            sys.executable,
            "tests/bench/relay_bench.py",
            "--smoke",
            "--otel",
            "--no-nginx",
            "--workers",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout.split("--otel:", 1)[1]
    assert "| metric | pw×1 | pw×1+otel | added by --otel |" in out, out
    for row in ("(a) TTFT p50 ms, concurrency 1", "CPU µs/request", "CPU µs/event"):
        assert re.search(re.escape(row) + r"[^|]*\| [\d.,]+ \| [\d.,]+ \| -?[\d.,]+ \|", out), (
            row,
            out,
        )
