"""Prefix affinity under attack: prompts cannot be aimed at one member, and one hot
prefix cannot pin a pool's whole load on one member.

- The prefix hash is keyed with the deployment's secret: prompts an attacker picked (with
  the hash as it was unkeyed) to land on one member land there no more often than chance.
  Two phasewatch replicas given one ``--affinity-secret`` send each prefix to the same
  member; two started without one do not agree.
- Bounded loads: 160 concurrent requests sharing one prefix over two members are not all
  on one; the home takes at most its bound and the rest spill over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
from collections import Counter

import httpx

from proxy.fleet.balance import prefix_key, rendezvous

from ...support.fake_engine import FakeEngine, completion, json_response
from ...support.servers import start_proxy

MODEL = "m"


def body(system: str, user: str = "q") -> dict:
    return {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def homes(proxy, prompts: list[str]) -> list[str]:
    """The member each prompt's request went to, one request at a time."""
    with httpx.Client(timeout=30) as c:
        for p in prompts:
            assert c.post(proxy.url + "/v1/chat/completions", json=body(p)).status_code == 200
    lines = proxy.request_lines(at_least=len(prompts))
    return [x["upstream"] for x in lines[-len(prompts) :]]


def aimed_at(member: str, other: str, n: int) -> list[str]:
    """`n` prompts whose unkeyed prefix hash ranks `member` first: what an attacker finds
    offline when the hash has no key (about two tries a prompt)."""
    found: list[str] = []
    i = 0
    while len(found) < n:
        p = f"aimed {i}"
        i += 1
        key = prefix_key(json.dumps(body(p)).encode())
        assert key is not None
        if rendezvous(key, member, 1.0) > rendezvous(key, other, 1.0):
            found.append(p)
    return found


def test_prompts_aimed_with_the_unkeyed_hash_land_by_chance_and_replicas_agree():
    a, b = FakeEngine(models=[MODEL]).start(), FakeEngine(models=[MODEL]).start()
    args = ["--affinity", "prefix", "--engine-scrape", "0"]
    shared = [*args, "--affinity-secret", "one deployment's secret"]
    proxies = [
        start_proxy(f"a={a.url}", f"b={b.url}", args=args),
        start_proxy(f"a={a.url}", f"b={b.url}", args=shared),
        start_proxy(f"a={a.url}", f"b={b.url}", args=shared),
        start_proxy(f"a={a.url}", f"b={b.url}", args=args),
    ]
    try:
        aimed = aimed_at("a", "b", 100)
        landed = Counter(homes(proxies[0], aimed))
        print(f"100 prompts aimed at a: {dict(landed)}")
        assert landed["a"] <= 75, landed  # chance: 50 +- 5
        assert any("replicas of phasewatch" in line for line in proxies[0].log().splitlines())
        prompts = [f"persona {i}" for i in range(30)]
        first, second = homes(proxies[1], prompts), homes(proxies[2], prompts)
        assert first == second  # one secret: one member per prefix across replicas
        assert set(first) == {"a", "b"}
        assert homes(proxies[3], prompts) != homes(proxies[0], prompts)  # per-start keys
    finally:
        for p in proxies:
            p.stop()
        a.stop()
        b.stop()


def slow_engine(delay: float) -> FakeEngine:
    """An engine that answers each chat after `delay` s, counting how many it holds."""

    async def script(req, reader, writer):
        engine.holding += 1  # type: ignore[attr-defined]
        engine.peak = max(engine.peak, engine.holding)  # type: ignore[attr-defined]
        await asyncio.sleep(delay)
        engine.holding -= 1  # type: ignore[attr-defined]
        writer.write(json_response(200, completion(MODEL)))
        await writer.drain()

    engine = FakeEngine(models=[MODEL], script=script)
    engine.holding = engine.peak = 0  # type: ignore[attr-defined]
    return engine.start()


def test_one_hot_prefix_spills_over_instead_of_pinning_one_member():
    a, b = slow_engine(0.2), slow_engine(0.2)
    proxy = start_proxy(
        f"a={a.url}", f"b={b.url}", args=["--affinity", "prefix", "--engine-scrape", "0"]
    )
    try:
        shared = "You are the support assistant of one product. " * 20

        def one(i: int) -> int:
            r = httpx.post(
                proxy.url + "/v1/chat/completions", json=body(shared, f"q{i}"), timeout=60
            )
            return r.status_code

        with cf.ThreadPoolExecutor(32) as pool:
            codes = list(pool.map(one, range(160)))
        assert codes == [200] * 160
        got = Counter(x["upstream"] for x in proxy.request_lines(at_least=160))
        peaks = {"a": a.peak, "b": b.peak}  # type: ignore[attr-defined]
        print(f"160 requests of one prefix, 32 at a time: {dict(got)}, peak held {peaks}")
        assert min(got["a"], got["b"]) >= 40, got
        # no member held more than its bound: 1.25 x half of 32 in flight, rounded up
        assert max(peaks.values()) <= 21, peaks
    finally:
        proxy.stop()
        a.stop()
        b.stop()
