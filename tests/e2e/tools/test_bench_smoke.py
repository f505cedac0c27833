"""The relay benchmark runs (briefly) and prints its table: a smoke run, not a timing test.

Speed targets are read off the full run's table (docs/performance.md), never asserted here.
"""

import re
import subprocess
import sys

from ...support.servers import ROOT


def test_relay_benchmark_smoke():
    res = subprocess.run(
        [
            sys.executable,
            "tests/bench/relay_bench.py",
            "--smoke",
            "--workers",
            "1,2",
            "--byte-relay",
            "--probe",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    head = next(line for line in out.splitlines() if line.strip().startswith("metric"))
    # phasewatch (also with 2 workers) beside the byte relay (the floor of a Python
    # proxy), whose ratio column is printed
    for name in ("direct", "plain", "bytes", "pw", "pw×2"):
        assert name in head, head
    assert "pw/bytes" in head, head
    for row in (
        "(a) added TTFT p50 ms",
        "(b) c8 events/s",
        "(b) c8 CPU µs/event",
        "(c) p8 CPU µs/event",
        "(b) c8 new request TTFT p50 ms",
        "(c) p8 new request TTFT p50 ms",
        "(c) p8 decode tok/s mean",
        "(c) p8 gap p99 ms",
        "(c) p8 context switches/event",
        "(c) p8 preemptions/event",
        "(e) c8 CPU µs/request, 2-token streams",
        "(d) peak RSS MiB/proc",
    ):
        assert re.search(re.escape(row) + r"\s+\S", out), (row, out)
    # each round's own ratio beside the medians (one round in the smoke run)
    assert re.search(
        r"pw/bytes, each round's ratio.*\n\s+\(b\) c8 CPU µs/event\s+(\d+\.\d\d×|—)", out
    ), out
    assert re.search(r"\(c\) p8 CPU µs/event\s+(\d+\.\d\d×|—)\n", out), out
    assert "scaling c8:" in out, out
    assert "INCOMPLETE" not in out, out
