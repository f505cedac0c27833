"""``phasewatch advise``: which phase to tune, from phasewatch's own measurements.

Reads a ``/metrics`` page or a Prometheus server exactly as ``report`` does
(:func:`proxy.tools.report.read`); the rows are :mod:`proxy.measure.advice`'s, the same
ones the report's advice section, the status page's panel and
``GET /phasewatch/api/advice`` show.
"""

from __future__ import annotations

import json
import sys

from ..measure.advice import advise
from ..measure.summary import build
from .report import add_reading_arguments, advice_markdown, read


def run(args) -> int:
    import httpx

    try:
        source, samples = read(args)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"phasewatch advise: {exc}", file=sys.stderr)
        return 1
    rep = build(samples, source=source)
    rows = advise(samples, rep)
    engines = {r.upstream: r.engine for r in rep.rows if r.engine}
    if args.format == "json":
        out = [{**r.as_dict(), "engine": engines.get(r.upstream, "")} for r in rows]
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        sys.stdout.write(advice_markdown(rows, engines))
    return 0


def add_arguments(parser) -> None:
    add_reading_arguments(parser)
