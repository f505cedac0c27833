"""The dashboards and alerts held to the ecosystem's lint rules, ported to a test.

Dashboards (grafana/dashboard-linter's rules):
- template-datasource-rule: exactly one data source variable, named ``datasource``, of
  Prometheus;
- panel-datasource-rule: every panel and query uses that variable;
- panel-units-rule: every stat, table, time series and gauge panel has a unit Grafana
  knows (its unit categories), unless value mappings give its text;
- panel-title-description-rule: every panel has a title and a description;
- target-promql-rule: every query parses (promtool checks each as a rule's expression,
  Grafana's variables substituted as the linter does);
- target-rate-interval-rule: a range under ``rate``/``irate`` is ``$__rate_interval``;
- target-counter-agg-rule: a ``_total`` series appears only inside ``rate``, ``irate``
  or ``increase``.

Alerts (monitoring-mixins/mixtool's lint): CamelCase names (a capital first, letters and
digits only) of at most 40 characters; a
``severity`` label of ``warning``, ``critical`` or ``info``; a ``summary`` annotation
that does not template (it reads the same in every notification) and a ``description``
that does (it names what fired).

Every query also runs against a real Prometheus in tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from ..support.prometheus import tool
from ..support.servers import ROOT

DASH_DIR = ROOT / "grafana" / "dashboards"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
RULE_FILES = sorted(p for p in RULES_DIR.glob("*.yml") if not p.name.endswith("_test.yml"))

#: Grafana's unit ids (packages/grafana-data/src/valueFormats/categories.ts), as
#: dashboard-linter enumerates them.
GRAFANA_UNITS = frozenset(
    "none string short percent percentunit humidity dB hex0x hex sci locale pixel "
    "flops mflops gflops tflops pflops bytes decbytes bits decbits kbytes deckbytes mbytes "
    "decmbytes gbytes decgbytes tbytes dectbytes pbytes decpbytes pps binBps Bps binbps bps "
    "KiBs Kibits KBs Kbits MiBs Mibits MBs Mbits GiBs Gibits GBs Gbits TiBs Tibits TBs Tbits "
    "dateTimeAsIso dateTimeAsIsoNoDateIfToday dateTimeAsUS dateTimeAsUSNoDateIfToday "
    "dateTimeAsLocal dateTimeAsLocalNoDateIfToday dateTimeAsSystem dateTimeFromNow "
    "watt kwatt megwatt gwatt mwatt Wm2 voltamp kvoltamp voltampreact kvoltampreact watth "
    "watthperkg kwatth kwattm amph kamph mamph joule ev amp kamp mamp volt kvolt mvolt dBm "
    "celsius fahrenheit kelvin hertz ns µs ms s m h d dtdurationms dtdurations dthms dtdhms "
    "timeticks clockms clocks cps ops reqps rps wps iops cpm opm rpm wpm bool bool_yes_no "
    "bool_on_off".split()
)
#: Lint exclusions, as dashboard-linter's .lint file would list them, each with its
#: reason: Grafana custom units for what its categories have no unit for.
UNIT_EXCLUSIONS = {
    "suffix: tok/s": "tokens per second: Grafana has no token unit",
    "suffix:x": "speed-up ratios (2.5x)",
}
UNIT_PANELS = ("stat", "singlestat", "graph", "table", "timeseries", "gauge")
#: What Grafana's variables become before parsing (dashboard-linter substitutes the same
#: way: magic durations for the interval variables, a regex for the others).
GLOBALS = {
    "$__rate_interval": "8869ms",
    "$__interval": "4867ms",
    "$__range": "6h",
    "$__range_s": "21600",
}
DATASOURCES = ("$datasource", "${datasource}")


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASH_DIR.glob("*.json"))}


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def targets() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every Prometheus query."""
    return [
        (name, p["title"], t["expr"])
        for name, d in dashboards().items()
        for p in panels(d)
        for t in p.get("targets", [])
        if t.get("expr")
    ]


def substitute(expr: str, variables: list[dict]) -> str:
    for k, v in GLOBALS.items():
        expr = expr.replace(k, v)
    for var in variables:
        for form in ("${{{}}}".format(var["name"]), "$" + var["name"]):
            expr = expr.replace(form, "x")
    return expr


def ds_uid(ds) -> str | None:
    return ds.get("uid") if isinstance(ds, dict) else ds


# --- template-datasource-rule, panel-datasource-rule ----------------------------------------


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_one_templated_prometheus_datasource(name):
    d = dashboards()[name]
    sources = [v for v in d["templating"]["list"] if v["type"] == "datasource"]
    assert len(sources) == 1, f"{name}: {len(sources)} data source variables"
    assert sources[0]["name"] == "datasource" and sources[0]["query"] == "prometheus"
    others = [v for v in d["templating"]["list"] if v["type"] != "datasource"]
    for v in others:
        if "datasource" in v:
            assert ds_uid(v["datasource"]) in DATASOURCES, f"{name}: variable {v['name']}"
    for p in panels(d):
        if p["type"] == "row":
            continue
        assert ds_uid(p.get("datasource")) in DATASOURCES, f"{name}: {p['title']}"
        for t in p.get("targets", []):
            assert ds_uid(t.get("datasource")) in DATASOURCES, f"{name}: {p['title']}"


# --- panel-units-rule, panel-title-description-rule ------------------------------------------


def configured_unit(p: dict) -> str | None:
    """The unit a panel shows: an override's, else the default's (dashboard-linter)."""
    fc = p.get("fieldConfig") or {}
    for o in fc.get("overrides", []):
        for prop in o.get("properties", []):
            if prop.get("id") == "unit":
                return prop.get("value")
    return (fc.get("defaults") or {}).get("unit")


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_every_panel_has_a_valid_unit_a_title_and_a_description(name):
    bad = []
    for p in panels(dashboards()[name]):
        if p["type"] == "row":
            assert p.get("title"), f"{name}: a row without a title"
            continue
        if not (p.get("title") and p.get("description")):
            bad.append(f"{p.get('title')!r}: no title or no description")
        if p["type"] not in UNIT_PANELS:
            continue
        fc = p.get("fieldConfig") or {}
        if (fc.get("defaults") or {}).get("mappings"):
            continue  # the mappings give the text (the linter's exclusion)
        units = [configured_unit(p)] + [
            prop["value"]
            for o in fc.get("overrides", [])
            for prop in o.get("properties", [])
            if prop.get("id") == "unit"
        ]
        for unit in units:
            if unit not in GRAFANA_UNITS and unit not in UNIT_EXCLUSIONS:
                bad.append(f"{p['title']!r}: unit {unit!r}")
    assert not bad, f"{name}: " + "; ".join(bad)


# --- target-promql-rule ----------------------------------------------------------------------


def test_every_query_parses():
    """Each dashboard query and variable query, its variables substituted, is checked by
    promtool as a recording rule's expression (promtool parses it with Prometheus's own
    parser)."""
    rules = []
    for _name, d in dashboards().items():
        variables = d["templating"]["list"]
        for p in panels(d):
            for t in p.get("targets", []):
                if t.get("expr"):
                    rules.append(substitute(t["expr"], variables))
        for v in variables:
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", q or "")
            if m:  # Grafana's own function around a selector: the selector must parse
                rules.append(substitute(m.group(1), variables))
    assert len(rules) > 50
    doc = {
        "groups": [
            {
                "name": "dashboards",
                "rules": [{"record": f"lint:query_{i}", "expr": e} for i, e in enumerate(rules)],
            }
        ]
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "queries.yml"
        path.write_text(yaml.safe_dump(doc))
        res = subprocess.run(
            [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True
        )
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_query_that_does_not_parse_is_found():
    """The check above can fail: promtool refuses a broken expression."""
    doc = {"groups": [{"name": "x", "rules": [{"record": "lint:x", "expr": "sum(rate(x[5m])"}]}]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.yml"
        path.write_text(yaml.safe_dump(doc))
        res = subprocess.run(
            [tool("promtool"), "check", "rules", str(path)], capture_output=True, text=True
        )
    assert res.returncode != 0


# --- target-rate-interval-rule, target-counter-agg-rule ---------------------------------------


def calls(expr: str, names: tuple[str, ...]) -> list[tuple[str, str]]:
    """(function, argument text) of every call of the named functions in `expr`."""
    out = []
    for m in re.finditer(r"\b({})\s*\(".format("|".join(names)), expr):
        depth, i = 1, m.end()
        while i < len(expr) and depth:
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        out.append((m.group(1), expr[m.end() : i - 1]))
    return out


def rate_interval_findings(expr: str) -> list[str]:
    found = []
    for fn, arg in calls(expr, ("rate", "irate")):
        inner = [a for f, a in calls(arg, ("rate", "irate", "increase"))]
        ranges = re.findall(r"\[([^\]:]+)\]", arg)
        nested = sum(len(re.findall(r"\[([^\]:]+)\]", a)) for a in inner)
        for r in ranges[: len(ranges) - nested] if nested else ranges:
            if r.strip() != "$__rate_interval":
                found.append(f"{fn}(...[{r}])")
    return found


def counter_findings(expr: str) -> list[str]:
    found = []
    for m in re.finditer(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*_total\b", expr):
        before = expr[: m.start()].rstrip()
        if not re.search(r"\b(rate|irate|increase)\s*\($", before):
            found.append(m.group(0))
    return found


def test_rates_use_rate_interval_and_counters_are_rated():
    bad = []
    for name, title, expr in targets():
        bad += [f"{name} {title!r}: {f}" for f in rate_interval_findings(expr)]
        bad += [f"{name} {title!r}: bare counter {f}" for f in counter_findings(expr)]
    assert not bad, "\n".join(bad)


def test_the_query_rules_find_what_they_look_for():
    assert rate_interval_findings("sum(rate(x_total[5m]))") == ["rate(...[5m])"]
    assert rate_interval_findings("sum(rate(x_total[$__rate_interval]))") == []
    assert rate_interval_findings("sum(increase(x_total[$__range]))") == []
    assert counter_findings("sum(x_total)") == ["x_total"]
    assert counter_findings('sum(increase(x_total{a="b"}[$__range]))') == []
    assert counter_findings("label_values(phasewatch_gpu_energy_joules_total, gpu)") == [
        "phasewatch_gpu_energy_joules_total"
    ]


# --- mixtool's alert rules -----------------------------------------------------------------


def alerts() -> list[dict]:
    return [
        r
        for path in RULE_FILES
        for g in yaml.safe_load(path.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    ]


def alert_findings(rule: dict) -> list[str]:
    found = []
    name = rule["alert"]
    if not re.fullmatch(r"[A-Z][A-Za-z0-9]*", name):  # acronyms kept: KubeAPIDown
        found.append("not CamelCase")
    if len(name) > 40:
        found.append("name over 40 characters")
    if rule.get("labels", {}).get("severity") not in ("warning", "critical", "info"):
        found.append(f"severity {rule.get('labels', {}).get('severity')!r}")
    ann = rule.get("annotations", {})
    if not ann.get("summary") or "{{" in ann["summary"]:
        found.append("summary missing or templated")
    if "{{" not in ann.get("description", ""):
        found.append("description does not template")
    return found


def test_alerts_follow_mixtool_rules():
    bad = {r["alert"]: f for r in alerts() if (f := alert_findings(r))}
    assert not bad, bad
    assert len(alerts()) >= 10


def test_the_alert_rules_find_what_they_look_for():
    good = {
        "alert": "UpstreamStalled",
        "labels": {"severity": "critical"},
        "annotations": {"summary": "Streams stopped.", "description": "{{ $labels.upstream }}"},
    }
    assert alert_findings(good) == []
    assert alert_findings({**good, "alert": "upstream_stalled"}) == ["not CamelCase"]
    assert alert_findings({**good, "alert": "A" + "b" * 40}) == ["name over 40 characters"]
    assert alert_findings({**good, "labels": {"severity": "page"}}) == ["severity 'page'"]
    templated = {"summary": "{{ $value }} down", "description": "static"}
    assert alert_findings({**good, "annotations": templated}) == [
        "summary missing or templated",
        "description does not template",
    ]
