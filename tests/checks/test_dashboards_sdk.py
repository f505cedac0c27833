"""The dashboards built with Grafana's foundation SDK keep what a user reads and what
Prometheus runs: every panel's title, type, place on the grid, description, unit, limits,
thresholds, mappings, legend, overrides, transformations and queries, and every variable
and dashboard link, as frozen in tests/fixtures/dashboards/contract.json (taken from the
hand-written JSON the SDK port replaced). Field order and the defaults the SDK writes out
may differ; none of these may.

After a deliberate dashboard change, rewrite the contract and review its diff:

    python -m tests.checks.test_dashboards_sdk --write
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASH_DIR = ROOT / "grafana" / "dashboards"
CONTRACT = ROOT / "tests" / "fixtures" / "dashboards" / "contract.json"

_TARGET = ("refId", "expr", "legendFormat", "instant", "range", "format", "exemplar")
_DEFAULTS = ("unit", "min", "max", "decimals", "thresholds", "mappings", "color")
_CUSTOM = ("fillOpacity", "stacking", "scaleDistribution", "thresholdsStyle", "hidden")
_VARIABLE = ("name", "type", "label", "description", "query", "current", "includeAll")
_VARIABLE2 = ("allValue", "multi", "options", "refresh", "sort", "datasource", "definition")


def _pick(d: dict, keys: tuple[str, ...]) -> dict:
    return {k: d[k] for k in keys if d.get(k) is not None}


def panel_contract(p: dict) -> dict:
    out = _pick(p, ("id", "type", "title", "description", "gridPos", "datasource"))
    if p["type"] == "row":
        return out | {"collapsed": p.get("collapsed", False)}
    defaults = p.get("fieldConfig", {}).get("defaults", {})
    out["defaults"] = _pick(defaults, _DEFAULTS)
    out["custom"] = _pick(defaults.get("custom", {}), _CUSTOM)
    out["overrides"] = p.get("fieldConfig", {}).get("overrides", [])
    options = p.get("options", {})
    out["legend"] = options.get("legend")
    out["tooltip"] = options.get("tooltip")
    out["reduce"] = options.get("reduceOptions")
    out["transformations"] = p.get("transformations", [])
    out["targets"] = [_pick(t, _TARGET) | {"ds": t["datasource"]} for t in p["targets"]]
    return out


def variable_contract(v: dict) -> dict:
    """A variable's fields; an empty current/options reads as absent, and a data source
    variable's refresh is left out (Grafana lists data sources on every load; the SDK's
    DatasourceVariable has no refresh to set)."""
    keys = _VARIABLE + _VARIABLE2
    if v["type"] == "datasource":
        keys = tuple(k for k in keys if k != "refresh")
    return {k: x for k, x in _pick(v, keys).items() if x not in ({}, [])}


def contract(dash: dict) -> dict:
    """What a dashboard must keep across a change of how it is written."""
    top = _pick(dash, ("uid", "title", "description", "tags", "refresh", "time", "editable"))
    top["graphTooltip"] = dash["graphTooltip"]
    top["links"] = dash["links"]
    top["annotations"] = dash["annotations"]["list"]
    top["refresh_intervals"] = dash["timepicker"]["refresh_intervals"]
    top["variables"] = [variable_contract(v) for v in dash["templating"]["list"]]
    top["panels"] = [panel_contract(p) for p in dash["panels"]]
    return top


def contracts(folder: Path = DASH_DIR) -> dict[str, dict]:
    return {p.name: contract(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))}


def test_sdk_dashboards_keep_the_contract():
    want = json.loads(CONTRACT.read_text())
    got = contracts()
    assert sorted(got) == sorted(want)
    for name in want:
        w, g = want[name], got[name]
        assert [p["title"] for p in g["panels"]] == [p["title"] for p in w["panels"]], name
        for wp, gp in zip(w["panels"], g["panels"]):
            assert gp == wp, f"{name}: panel {wp['title']!r} changed"
        assert {k: v for k, v in g.items() if k != "panels"} == {
            k: v for k, v in w.items() if k != "panels"
        }, name


def test_the_contract_covers_every_query():
    """The frozen list is not a sample: every panel and every query of the committed
    dashboards is in it (a dashboard with a panel more or less fails the test above)."""
    want = json.loads(CONTRACT.read_text())
    exprs = [t["expr"] for d in want.values() for p in d["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 100 and all(e.strip() for e in exprs)
    panels = [p for d in want.values() for p in d["panels"] if p["type"] != "row"]
    assert {p["type"] for p in panels} == {"timeseries", "stat", "bargauge", "heatmap", "table"}


def test_built_from_the_sdk_one_module_per_dashboard():
    src = ROOT / "grafana" / "dashboards_src"
    for name in ("overview", "precision", "power"):
        text = (src / f"{name}.py").read_text()
        assert "def build() -> dict:" in text, name
    assert "grafana_foundation_sdk" in (src / "common.py").read_text()
    # no module of grafana/ writes panel JSON by hand: the entry point only renders
    entry = (ROOT / "grafana" / "build_dashboards.py").read_text()
    assert '"timeseries"' not in entry and '"fieldConfig"' not in entry
    res = subprocess.run(
        [sys.executable, str(ROOT / "grafana" / "build_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.checks.test_dashboards_sdk --write")
    CONTRACT.parent.mkdir(parents=True, exist_ok=True)
    CONTRACT.write_text(
        json.dumps(contracts(), indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    )
    print("wrote", CONTRACT)
