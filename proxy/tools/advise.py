"""``phasewatch advise``: which phase to tune, from phasewatch's own measurements.

Reads a ``/metrics`` page or a Prometheus server exactly as ``report`` does
(:func:`proxy.tools.report.load`); the rows are :mod:`proxy.measure.advice`'s, the same
ones the report's advice section, the status page's panel and
``GET /phasewatch/api/advice`` show.
"""

from __future__ import annotations

import json
import sys

from ..measure.advice import advise
from ..measure.summary import build
from .report import advice_markdown, load


def run(args) -> int:
    import httpx

    try:
        samples = load(args.source, args.window)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"phasewatch advise: cannot read {args.source}: {exc}", file=sys.stderr)
        return 1
    rows = advise(samples, build(samples, source=args.source))
    if args.format == "json":
        sys.stdout.write(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
    else:
        sys.stdout.write(advice_markdown(rows))
    return 0


def add_arguments(parser) -> None:
    parser.add_argument(
        "--from",
        dest="source",
        default="http://127.0.0.1:8090",
        help="phasewatch base or /metrics URL, or a Prometheus server URL "
        "[default http://127.0.0.1:8090].",
    )
    parser.add_argument(
        "--window",
        default=None,
        help="With a Prometheus server: only traffic of the last WINDOW "
        "(a PromQL duration such as 15m or 1h); default: everything since start.",
    )
    parser.add_argument(
        "--format",
        choices=("markdown", "json"),
        default="markdown",
        help="Output format [default markdown].",
    )
