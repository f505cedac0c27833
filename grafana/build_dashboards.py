"""Builds the bundled Grafana dashboards (grafana/dashboards/*.json).

The JSON files are what Grafana loads (docker compose provisioning, the Kubernetes
sidecar ConfigMap); this script is how they are written, with Grafana Labs'
grafana-foundation-sdk (the `dashboards` extra), one module per dashboard in
grafana/dashboards_src/, so every panel gets a unit, a description and thresholds, and
every query filters on the same variables.

    python grafana/build_dashboards.py          # rewrite grafana/dashboards/*.json
    python grafana/build_dashboards.py --check  # exit 1 if the files are out of date

Every metric named here is defined in proxy/measure/metrics.py or is a recording rule in
deploy/prometheus/rules/phasewatch-recording.yml; tests/e2e/observability/test_observability.py checks
that, and runs every query against a real Prometheus fed by phasewatch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    from dashboards_src import overview, power, precision
except ImportError as exc:  # the SDK is a build-time dependency, not the proxy's
    raise SystemExit(
        f"{exc}: install the dashboards extra first (pip install -e '.[dashboards]')"
    ) from exc

OUT = Path(__file__).resolve().parent / "dashboards"

DASHBOARDS = {
    "phasewatch-overview.json": overview.build,
    "phasewatch-precision.json": precision.build,
    "phasewatch-power.json": power.build,
}


def render() -> dict[str, str]:
    """Each dashboard's JSON, indented by one space: readable, and small enough that the
    Kubernetes ConfigMap of all three stays under kubectl apply's 256 KiB limit."""
    return {
        name: json.dumps(build(), indent=1, ensure_ascii=False) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    files = render()
    if "--check" in argv:
        stale = [
            n
            for n, text in files.items()
            if not (OUT / n).exists() or (OUT / n).read_text() != text
        ]
        if stale:
            print("out of date (run python grafana/build_dashboards.py):", *stale)
            return 1
        return 0
    OUT.mkdir(exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
        print("wrote", OUT / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
