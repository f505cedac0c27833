"""What the SSE tap costs per event, in-process: this checkout beside earlier revisions.

The relay benchmark's CPU per event carries the whole machine's noise; this one times
only ``SSETap.feed`` on the benchmark upstream's token events (one event per read, as
engines write them at pace, and several per read, as they arrive at full speed), with
and without usage stripping, rounds interleaved between the revisions. Each revision is
imported from a temporary ``git archive`` of its ``proxy`` package under another name,
its compiled parts built (setup.py) where it has any.

    python tests/bench/tap_bench.py --baseline 982001e
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import sse_upstream  # noqa: E402


def _event(chunk: bytes) -> bytes:
    """An upstream chunk's data (the chunked framing undone)."""
    return chunk[chunk.index(b"\r\n") + 2 : -2]


def load(rev: str | None, tmp: Path) -> tuple:
    """(SSETap, Marks) of this checkout (None) or of git revision `rev`."""
    if rev is None:
        pkg = "proxy"
        sys.path.insert(0, str(ROOT))
    else:
        pkg = "pw_" + "".join(c if c.isalnum() else "_" for c in rev)
        dest = tmp / rev.replace("/", "_")
        dest.mkdir()
        has_setup = (
            subprocess.run(
                ["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:setup.py"], capture_output=True
            ).returncode
            == 0
        )
        paths = ["proxy", "setup.py"] if has_setup else ["proxy"]
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, *paths], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        if has_setup:  # its compiled parts, as an install of it has them
            subprocess.run(
                [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                cwd=dest,
                check=True,
                capture_output=True,
            )
        (dest / "proxy").rename(dest / pkg)
        sys.path.insert(0, str(dest))
    sse = importlib.import_module(f"{pkg}.engines.sse")
    timeline = importlib.import_module(f"{pkg}.measure.timeline")
    return sse.SSETap, timeline.Marks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", action="append", default=[], metavar="REV")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--events", type=int, default=100_000, help="events per measurement")
    args = p.parse_args(argv)
    token, role = _event(sse_upstream.TOKEN), _event(sse_upstream.ROLE)
    tmp = Path(tempfile.mkdtemp(prefix="pw-tap-bench-"))
    try:
        revs = [("this checkout", None)] + [(r, r) for r in args.baseline]
        taps = {name: load(rev, tmp) for name, rev in revs}
        cases = [(strip, k) for strip in (False, True) for k in (1, 4, 16)]
        best: dict[tuple, float] = {}
        for rnd in range(args.rounds):
            order = list(taps.items())
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name, (tap_cls, marks_cls) in order:
                for strip, k in cases:
                    tap = tap_cls(marks_cls(t_recv=0.0), strip=strip)
                    tap.feed(role, 0.0)
                    read, feed, n = token * k, tap.feed, max(1, args.events // k)
                    dt = timeit.timeit(lambda: feed(read, 1.0), number=n) / (n * k) * 1e6
                    key = (name, strip, k)
                    best[key] = min(best.get(key, dt), dt)
        names = list(taps)
        print(f"SSETap.feed, µs per event (best of {args.rounds} interleaved rounds)")
        print("| read | " + " | ".join(names) + " |" + "".join(f" this/{n} |" for n in names[1:]))
        print("| --- |" + " --: |" * (2 * len(names) - 1))
        for strip, k in cases:
            vals = [best[(n, strip, k)] for n in names]
            label = f"{k} event(s) per read{', usage stripped' if strip else ''}"
            ratios = "".join(f" {vals[0] / v:.2f}× |" for v in vals[1:])
            print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in vals) + " |" + ratios)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
