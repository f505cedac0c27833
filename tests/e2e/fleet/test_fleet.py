"""One model on several engines behind one URL: pools form from the model lists, requests
are spread by --balance, a dead member is ejected and a request that never reached it
goes to another, a stream cut by a dying member ends with the dialect's error event and
is never sent again, every member down is a 503 naming the pool; --affinity prefix keeps
a prompt prefix on one engine's cache; the engines' model-management endpoints obey
--admin-api, and a flood of listed models cannot displace a real one from routing."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys

import httpx
import pytest

from ...support.fake_engine import FakeEngine
from ...support.servers import (
    ROOT,
    free_port,
    metric_samples,
    sample,
    start_proxy,
    start_sim,
    wait_for,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def chat(proxy, content: str = "hi", max_tokens: int = 8, model: str = MODEL, **kw):
    return httpx.post(
        proxy.url + "/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **kw,
        },
        timeout=60,
    )


def test_two_upstreams_of_one_model_are_a_pool_spread_by_weight():
    a, b = start_sim("vllm", speed=8.0), start_sim("vllm", speed=8.0)
    proxy = start_proxy(
        f"a={a.url}",
        f"b={b.url}",
        args=["--balance", "round-robin", "--upstream-weight", "a=3", "--engine-scrape", "0"],
    )
    try:
        for i in range(20):
            assert chat(proxy, f"q{i}").status_code == 200
        assert (len(a.truth(at_least=15)), len(b.truth(at_least=5))) == (15, 5)
        samples = metric_samples(proxy.url)
        assert sample(samples, "phasewatch_pool_members", pool=MODEL) == 2
        assert sample(samples, "phasewatch_pool_members_up", pool=MODEL) == 2
        share_a = sample(samples, "phasewatch_pool_share", pool=MODEL, upstream="a")
        share_b = sample(samples, "phasewatch_pool_share", pool=MODEL, upstream="b")
        assert share_a > share_b > 0
        pools = httpx.get(proxy.url + "/phasewatch/api/summary").json()["pools"]
        assert {m["name"] for p in pools if p["pool"] == MODEL for m in p["members"]} == {"a", "b"}
    finally:
        proxy.stop()
        a.stop()
        b.stop()


def test_least_loaded_sends_more_to_the_faster_replica():
    fast, slow = start_sim("vllm", speed=8.0), start_sim("vllm", speed=1.0)
    proxy = start_proxy(f"fast={fast.url}", f"slow={slow.url}", args=["--engine-scrape", "0"])
    try:
        with cf.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda i: chat(proxy, f"q{i}", 32).status_code, range(48)))
        assert codes == [200] * 48
        lines = proxy.request_lines(at_least=48)
        n_fast = sum(1 for x in lines if x["upstream"] == "fast")
        n_slow = sum(1 for x in lines if x["upstream"] == "slow")
        print(f"least-loaded: fast {n_fast}, slow {n_slow}")
        assert n_fast > n_slow >= 1
    finally:
        proxy.stop()
        fast.stop()
        slow.stop()


def test_a_dead_member_is_ejected_its_requests_go_on_and_a_dead_pool_is_named():
    a, b = start_sim("vllm", speed=8.0), start_sim("vllm", speed=8.0)
    # no idle probe: the requests themselves find the dead member
    proxy = start_proxy(
        f"a={a.url}", f"b={b.url}", args=["--health-interval", "0", "--engine-scrape", "0"]
    )
    try:
        a.stop()
        for i in range(10):
            assert chat(proxy, f"q{i}").status_code == 200
        assert len(b.truth(at_least=10)) == 10
        samples = metric_samples(proxy.url)
        assert sample(samples, "phasewatch_upstream_ejections_total", upstream="a") == 1
        assert sample(samples, "phasewatch_pool_retries_total", pool=MODEL) == 1
        assert sample(samples, "phasewatch_pool_members_up", pool=MODEL) == 1
        summary = httpx.get(proxy.url + "/phasewatch/api/summary").json()
        assert {u["name"]: u["reason"] for u in summary["upstreams"]} == {
            "a": "connection refused",
            "b": None,
        }
        b.stop()
        got = [chat(proxy, "after") for _ in range(2)]
        assert got[0].status_code in (502, 503) and got[1].status_code == 503
        message = got[1].json()["error"]["message"]
        assert f"pool '{MODEL}'" in message and "a: connection refused" in message
        assert got[1].headers["retry-after"] == "1"
        assert httpx.get(proxy.url + "/phasewatch/ready").status_code == 503
        assert (
            sample(metric_samples(proxy.url), "phasewatch_rejected_total", reason="pool_down") == 1
        )
    finally:
        proxy.stop()
        a.stop()
        b.stop()


def test_a_stream_cut_by_a_dying_member_ends_with_an_error_event_and_is_not_resent():
    a, b = start_sim("vllm", speed=0.3), start_sim("vllm", speed=0.3)
    sims = {"a": a, "b": b}
    proxy = start_proxy(f"a={a.url}", f"b={b.url}", args=["--engine-scrape", "0"])
    try:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "long"}],
            "max_tokens": 400,
            "stream": True,
        }
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, timeout=60) as r:
            chunks = r.iter_raw()
            got = next(chunks)
            serving = wait_for(
                lambda: [
                    n
                    for n in sims
                    if sample(
                        metric_samples(proxy.url), "phasewatch_in_flight_requests", upstream=n
                    )
                    == 1
                ],
                what="the member serving the stream",
            )[0]
            other = sims["b" if serving == "a" else "a"]
            sims[serving].proc.kill()
            sims[serving].proc.wait()
            got += b"".join(chunks)
        events = [e for e in got.split(b"\n\n") if e.strip()]
        last = json.loads(events[-1].removeprefix(b"data: "))
        assert last["error"]["type"] == "upstream_error", events[-1]
        assert b"[DONE]" not in got
        ready = httpx.get(proxy.url + "/phasewatch/ready").json()
        assert {u["name"]: u["up"] for u in ready["upstreams"]}[serving] is False
        # never sent again: the other member saw no request at all
        assert other.truth() == []
        (line,) = proxy.request_lines(at_least=1)
        assert line["upstream"] == serving and line["outcome"] == "error"
    finally:
        proxy.stop()
        a.stop()
        b.stop()


def test_affinity_prefix_keeps_a_shared_system_prompt_on_one_engines_cache():
    a, b = start_sim("llamacpp", speed=8.0), start_sim("llamacpp", speed=8.0)
    proxy = start_proxy(
        f"a={a.url}", f"b={b.url}", args=["--affinity", "prefix", "--engine-scrape", "0"]
    )
    try:
        model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
        system = "You are the support assistant of one product. " * 30
        for i in range(8):
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {i}"},
                    ],
                },
                timeout=60,
            )
            assert r.status_code == 200
        lines = proxy.request_lines(at_least=8)
        homes = {x["upstream"] for x in lines}
        assert len(homes) == 1, homes
        home = a if homes == {"a"} else b
        truth = home.truth(at_least=8)
        assert truth[0]["cached_tokens"] == 0
        assert all(t["cached_tokens"] > 0 for t in truth[1:]), [t["cached_tokens"] for t in truth]
        # other prefixes spread over the pool
        for i in range(12):
            httpx.post(
                proxy.url + "/v1/chat/completions",
                json={
                    "model": model,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": f"persona {i}"},
                        {"role": "user", "content": "q"},
                    ],
                },
                timeout=60,
            )
        lines = proxy.request_lines(at_least=20)
        assert {x["upstream"] for x in lines[8:]} == {"a", "b"}
    finally:
        proxy.stop()
        a.stop()
        b.stop()


def admin(proxy, key: str, path: str = "/api/copy") -> httpx.Response:
    return httpx.post(
        proxy.url + path,
        json={"source": "llama3.1:8b", "destination": "x"},
        headers={"authorization": f"Bearer {key}"},
    )


def test_model_management_endpoints_obey_admin_api():
    sim = start_sim("ollama", speed=8.0)
    keys = ["--api-key", "team=k-team", "--api-key", "k-operator"]
    auto = start_proxy(sim.url, args=keys)
    keyed = start_proxy(sim.url, args=[*keys, "--admin-api", "keyed"])
    try:
        # auto with a key naming a client: deny, for every key
        for key in ("k-team", "k-operator"):
            r = admin(auto, key)
            assert r.status_code == 403 and "--admin-api deny" in r.text
        assert admin(auto, "k-team", "/api/delete").status_code == 403
        assert (
            sample(metric_samples_keyed(auto), "phasewatch_rejected_total", reason="admin_api") == 3
        )
        # what uses models still passes
        tags = httpx.get(auto.url + "/api/tags", headers={"authorization": "Bearer k-team"})
        assert tags.status_code == 200
        # keyed: the operator's bare key reaches the engine, a client's key does not
        assert admin(keyed, "k-team").status_code == 403
        assert admin(keyed, "k-operator").status_code != 403
    finally:
        auto.stop()
        keyed.stop()
        sim.stop()


def metric_samples_keyed(proxy):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(proxy.url + "/metrics", headers={"authorization": "Bearer k-operator"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_admin_api_keyed_needs_a_key_that_names_no_client():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            "--api-key",
            "team=k",
            "--admin-api",
            "keyed",
            "--port",
            str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0 and "--admin-api keyed needs" in run.stdout + run.stderr


@pytest.mark.parametrize("copies", [64, 500])
def test_a_flood_of_listed_models_does_not_displace_the_real_one(copies):
    eng = FakeEngine(models=[f"copy-{i}" for i in range(copies)] + ["real-model"]).start()
    sim = start_sim("vllm", speed=8.0)
    proxy = start_proxy(f"sim={sim.url}", f"eng={eng.url}", args=["--engine-scrape", "0"])
    try:
        r = chat(proxy, model="real-model")
        assert r.status_code == 200, r.text
        assert [r.json()["model"] for r in eng.posts()] == ["real-model"]
        assert sim.truth() == []
        # the label stays bounded: the real model past --max-models is labelled other
        (line,) = proxy.request_lines(at_least=1)
        assert line["upstream"] == "eng" and line["model"] == "other"
    finally:
        proxy.stop()
        sim.stop()
        eng.stop()


def bridge(proxy, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(proxy.url + f"/phasewatch/upstreams/{name}/metrics")
    assert r.status_code == 200, r.text
    return {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}


def test_the_router_bridge_writes_every_engines_load_in_vllms_names():
    ollama = start_sim("ollama", speed=0.3)
    llama = start_sim("llamacpp", speed=0.3)
    proxy = start_proxy(f"ol={ollama.url}", f"ll={llama.url}", args=["--engine-scrape", "0.2"])
    names = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    try:
        assert set(bridge(proxy, "ol")) == names and set(bridge(proxy, "ll")) == names
        assert bridge(proxy, "ol")["vllm:num_requests_running"] == 0
        assert httpx.get(proxy.url + "/phasewatch/upstreams/nope/metrics").status_code == 404
        model = httpx.get(ollama.url + "/api/tags").json()["models"][0]["name"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "long"}],
            "stream": True,
            "options": {"num_predict": 400},
        }
        with httpx.stream("POST", proxy.url + "/api/chat", json=body, timeout=60) as r:
            chunks = r.iter_raw()  # kept: a dropped iterator closes the stream
            next(chunks)
            # Ollama says nothing of its load: phasewatch's own count stands in
            wait_for(
                lambda: bridge(proxy, "ol")["vllm:num_requests_running"] == 1,
                what="the Ollama stream counted as running",
            )
    finally:
        proxy.stop()
        ollama.stop()
        llama.stop()
