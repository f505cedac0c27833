"""``phasewatch`` with a library candidate as its upstream client, for the benchmark.

    python tests/bench/pw_candidate.py KIND serve --upstream URL ...

KIND is one of tests/bench/candidates.py's CANDIDATES; everything after it is
phasewatch's own command line. The candidate replaces the transport each upstream is
built with; nothing else changes.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proxy.core import upstreams
from proxy.tools.cli import main
from tests.bench.candidates import CANDIDATES, candidate_transport


def run(argv: list[str]) -> int:
    kind, args = argv[0], argv[1:]
    if kind not in CANDIDATES:
        raise SystemExit(f"unknown candidate {kind!r} (one of {', '.join(CANDIDATES)})")
    upstreams.make_transport = lambda options, name="": candidate_transport(  # type: ignore[assignment]
        replace(options, kind=kind), name
    )
    return main(args)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
