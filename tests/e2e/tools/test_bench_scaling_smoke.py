"""The relay benchmark's --workers curve runs (briefly), its load spread over client and
upstream processes, pinned (--pin) beside a busy neighbour (--busy): a smoke run, not a
timing test (issues 26, 43).

What the curve says is read off a full run on a many-core machine, never asserted here.
"""

import re
import subprocess
import sys

from ...support.servers import ROOT


def test_scaling_curve_smoke():
    res = subprocess.run(
        [
            sys.executable,
            "tests/bench/relay_bench.py",
            "--smoke",
            "--workers",
            "1,2",
            "--client-procs",
            "2",
            "--upstream-procs",
            "2",
            "--no-plain",
            "--no-nginx",
            "--pin",
            "--busy",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "INCOMPLETE" not in out, out
    head = next(line for line in out.splitlines() if line.strip().startswith("metric"))
    assert "plain" not in head, head
    assert "2 client process(es), 2 upstream process(es)" in out, out
    assert re.search(r"pinned: contenders on CPU \[\d+\]", out), out
    assert "1 busy neighbour(s) at nice 19, unpinned" in out, out
    for row in ("(b) c8 events/s", "(b) c8 CPU µs/event", "(c) p8 CPU µs/event"):
        # one column per worker count, each with a figure
        assert re.search(re.escape(f"| {row} |") + r"[^|\n]*\d[^|\n]*\|[^|\n]*\d", out), (row, out)
    assert re.search(r"scaling c8: pw [\d,]+ events/s \(1\.00×, \S+ µs/event\)", out), out


def test_tap_bench_smoke():
    """The in-process tap benchmark runs beside a revision and prints its ratios."""
    res = subprocess.run(
        [
            sys.executable,
            "tests/bench/tap_bench.py",
            "--baseline",
            "HEAD",
            "--rounds",
            "1",
            "--events",
            "2000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [line for line in res.stdout.splitlines() if "event(s) per read" in line]
    assert len(lines) == 6, res.stdout
    assert all(re.search(r"\| [\d.]+ \| [\d.]+ \| [\d.]+× \|$", line) for line in lines), lines
