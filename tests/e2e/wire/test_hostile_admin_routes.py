"""Every engine's management routes obey ``--admin-api``, checked against the engines' own
route tables (``tests/fixtures/engine-routes``: llama-server's read from its source,
router mode included; vLLM's routers, dev mode included; SGLang's and trtllm-serve's route tables).

With ``--admin-api deny`` each route the table marks as managing the engine is refused
with a 403 and never reaches it, in every engine's dialect (the engine behind an
upstream may not be detected yet); every other route still reaches the engine.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from proxy.engines import ADMIN_PATHS, ENGINES, is_admin_path

from ...support.fake_engine import FakeEngine
from ...support.servers import ROOT, metric_samples, sample, start_proxy

TABLES = ROOT / "tests" / "fixtures" / "engine-routes"
ENGINE_OF = {"llama-server": "llamacpp", "vllm": "vllm", "sglang": "sglang", "trtllm": "trtllm"}


def routes(table: str) -> list[dict]:
    return json.loads((TABLES / f"{table}.json").read_text())["routes"]


def concrete(path: str) -> str:
    """A route's path with its parameters filled in (``/slots/:id_slot`` -> ``/slots/0``)."""
    return re.sub(r"\{[^}]+\}|:[a-z_]+", "0", path)


@pytest.mark.parametrize("table", sorted(ENGINE_OF))
def test_the_engines_admin_list_covers_every_management_route_of_its_table(table):
    own = ENGINES[ENGINE_OF[table]].admin_paths
    for r in routes(table):
        path = concrete(r["path"])
        covered = path in own or any(path.startswith(p + "/") for p in own)
        if r["management"]:
            assert covered, f"{table}: {r['method']} {r['path']} is not in its admin list"
        elif r["method"] not in ("GET", "HEAD"):
            # a route that is not management is never refused as one
            assert not is_admin_path(path), f"{r['method']} {r['path']} refused as admin"
    assert own <= ADMIN_PATHS


@pytest.mark.parametrize("table", sorted(ENGINE_OF))
def test_admin_api_deny_refuses_every_management_route_and_relays_the_rest(table):
    engine = FakeEngine(models=["m"]).start()
    proxy = start_proxy(f"e={engine.url}", args=["--admin-api", "deny", "--engine-scrape", "0"])
    try:
        refused = relayed = 0
        for r in routes(table):
            method, path = r["method"], concrete(r["path"])
            before = len(engine.requests)
            got = httpx.request(method, proxy.url + path, json={"model": "m"}, timeout=30)
            reached = [q for q in engine.requests[before:] if q.target.split("?")[0] == path]
            if r["management"]:
                assert got.status_code == 403, (method, path, got.status_code)
                assert "--admin-api deny" in got.json()["error"]["message"]
                assert reached == [], f"{method} {path} reached the engine"
                refused += 1
            else:
                assert got.status_code != 403, (method, path)
                if path not in ("/metrics", "/v1/models", "/models"):  # answered by phasewatch
                    assert reached, f"{method} {path} did not reach the engine"
                relayed += 1
        print(f"{table}: {refused} management routes refused, {relayed} others relayed")
        counted = sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="admin_api")
        assert counted == refused > 0
    finally:
        proxy.stop()
        engine.stop()
