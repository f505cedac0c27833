"""The overhead benchmark runs (briefly) and prints its figures: a smoke run, not a timing test."""

import re
import subprocess
import sys

from .servers import ROOT


def test_overhead_benchmark_smoke():
    res = subprocess.run([sys.executable, "tests/bench/overhead.py", "--requests", "5",
                          "--tokens", "16", "--concurrency", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert re.search(r"added TTFT\s+p50\s+-?\d+\.\d+ ms", res.stdout), res.stdout
    m = re.search(r"proxy CPU\s+(\d+\.\d+) µs per streamed event \((\d+) events", res.stdout)
    assert m and int(m.group(2)) == 8 * 18 and float(m.group(1)) > 0  # 8 x (role + 16 + [DONE])
