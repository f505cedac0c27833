"""A new engine's endpoints need no dashboard or rule change: the dashboards and the
Prometheus rules select generation and whole-body requests by the kind the proxy exports
(``phasewatch_endpoint_info{endpoint, kind}``), never by listing endpoint labels, and the
dashboard builder does not read the engine registry at all.

That the selection returns what it should is checked end to end against a real Prometheus
in tests/e2e/observability/test_observability.py (every panel returns data)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from proxy.engines import ENDPOINT_KINDS, ENGINES

from ..support.servers import ROOT

DASH_DIR = ROOT / "grafana" / "dashboards"
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
K8S_RULES = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"

#: A PromQL matcher on the endpoint label: `endpoint="chat"`, `endpoint=~"a|b"`, ...
ENDPOINT_MATCHER = re.compile(r"\bendpoint\s*(=~|!~|!=|=)")


def _exprs_of(node: object) -> list[str]:
    """Every `expr` string anywhere in a dashboard or rule document."""
    if isinstance(node, dict):
        out = [v for k, v in node.items() if k == "expr" and isinstance(v, str)]
        for v in node.values():
            out += _exprs_of(v)
        return out
    if isinstance(node, list):
        return [e for v in node for e in _exprs_of(v)]
    return []


def query_texts() -> dict[str, list[str]]:
    """Every query of every bundled dashboard and every rule file (compose and k8s)."""
    out = {p.name: _exprs_of(json.loads(p.read_text())) for p in DASH_DIR.glob("*.json")}
    for path in RULES_DIR.glob("*.yml"):
        if not path.name.endswith("_test.yml"):
            out[path.name] = _exprs_of(yaml.safe_load(path.read_text()))
    out[K8S_RULES.name] = _exprs_of(yaml.safe_load(K8S_RULES.read_text()))
    return out


def test_no_query_names_an_endpoint():
    texts = query_texts()
    assert sum(map(len, texts.values())) > 100  # the queries were found
    labels = re.compile(r"\b(" + "|".join(map(re.escape, ENDPOINT_KINDS)) + r")\b")
    for name, exprs in texts.items():
        for expr in exprs:
            assert not ENDPOINT_MATCHER.search(expr), (name, expr)
            # nor in any string of it (a regex alternative, a label_replace value)
            for text in re.findall(r'"([^"]*)"', expr):
                assert not labels.search(text), (name, expr)


def test_generation_panels_select_by_kind():
    """The overview's generation and whole-body panels join on the exported kind."""
    exprs = [e for es in query_texts().values() for e in es]
    for kind in ("generation", "whole_body"):
        assert any(
            f'and on (endpoint) phasewatch_endpoint_info{{kind="{kind}"}}' in e for e in exprs
        ), kind


def test_the_dashboard_builder_reads_no_engine_registry():
    """Built in a fresh interpreter that cannot import the proxy, the dashboards are the
    committed ones: nothing an engine declares can change them."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name == 'proxy' or name.startswith('proxy.'):\n"
        "        raise ImportError('the dashboards may not read ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "sys.argv = ['build_dashboards.py', '--check']\n"
        "sys.path.insert(0, 'grafana')\n"
        "import runpy\n"
        "runpy.run_path('grafana/build_dashboards.py', run_name='__main__')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_every_engine_agrees_on_each_endpoint_kind():
    """One label, one kind: a label that generates on one engine and answers whole on
    another would put its series in both kinds' panels."""
    seen: dict[str, set[str]] = {}
    for engine in ENGINES.values():
        for label in engine.endpoints.values():
            kind = "whole_body" if label in engine.whole_endpoints else "generation"
            seen.setdefault(label, set()).add(kind)
    assert {label: kinds for label, kinds in seen.items() if len(kinds) > 1} == {}
    assert {label: kinds.pop() for label, kinds in seen.items()} == ENDPOINT_KINDS
    assert set(ENDPOINT_KINDS.values()) == {"generation", "whole_body"}
