"""The balancing policy on its own (proxy.fleet.balance) and the pools it serves
(proxy.fleet.pool) with real upstream objects: who is picked, in what order, and why."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.fleet.balance import BalanceOptions, Balancer, Load, expected_wait, prefix_key
from proxy.fleet.pool import PoolDown
from proxy.measure.metrics import Metrics


def picks(balancer: Balancer, members: list[Load], n: int, key=None) -> Counter:
    return Counter(balancer.order("p", members, key)[0].name for _ in range(n))


def test_round_robin_is_weighted_and_interleaved():
    b = Balancer(BalanceOptions("round-robin"))
    members = [Load("a", weight=3), Load("b", weight=1)]
    order = [b.order("p", members)[0].name for _ in range(8)]
    assert Counter(order) == {"a": 6, "b": 2}
    assert "bb" not in "".join(order) and "aaaa" not in "".join(order)


def test_random_follows_the_weights():
    b = Balancer(BalanceOptions("random"), rng=random.Random(7))
    got = picks(b, [Load("a", weight=4), Load("b", weight=1)], 5000)
    assert 0.75 < got["a"] / 5000 < 0.85


def test_least_loaded_takes_the_least_expected_wait():
    b = Balancer(BalanceOptions("least-loaded"))
    fast = Load("fast", in_flight=3, service_s=0.1)  # (3+1) x 0.1 = 0.4
    slow = Load("slow", in_flight=0, service_s=1.0)  # (0+1) x 1.0 = 1.0
    assert b.order("p", [slow, fast])[0].name == "fast"
    fast.in_flight = 12  # 1.3 > 1.0
    assert b.order("p", [slow, fast])[0].name == "slow"


def test_least_loaded_counts_the_engines_own_queue_and_kv_pressure():
    b = Balancer(BalanceOptions("least-loaded"))
    a = Load("a", service_s=0.5, engine_running=4, engine_waiting=6)  # others' traffic
    c = Load("c", service_s=0.5, in_flight=2)
    assert b.order("p", [a, c])[0].name == "c"
    full = Load("full", service_s=0.5, kv_usage=0.99)
    free = Load("free", service_s=0.5, kv_usage=0.5)
    assert expected_wait(full, 1.0) > expected_wait(free, 1.0)
    assert b.order("p", [full, free])[0].name == "free"


def test_an_unmeasured_replica_is_taken_as_fast_as_the_fastest_and_ties_alternate():
    b = Balancer(BalanceOptions("least-loaded"))
    new = Load("new")
    known = Load("known", service_s=0.2)
    assert expected_wait(new, 0.2) == expected_wait(known, 0.2)
    assert picks(b, [new, known], 10) == {"new": 5, "known": 5}


def test_the_fallbacks_follow_the_winner_in_order_of_expected_wait():
    b = Balancer(BalanceOptions("round-robin"))
    members = [Load("a", service_s=1.0), Load("b", service_s=0.1), Load("c", service_s=0.5)]
    first, *rest = b.order("p", members)
    assert [m.name for m in rest] == sorted(
        (m.name for m in members if m is not first),
        key=lambda n: {"a": 1.0, "b": 0.1, "c": 0.5}[n],
    )


def chat(system: str, user: str) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        }
    ).encode()


def test_prefix_key_reads_the_prompts_leading_bytes_only():
    long_system = "You are a careful assistant. " * 40  # over 512 bytes
    assert prefix_key(chat(long_system, "one")) == prefix_key(chat(long_system, "two"))
    assert prefix_key(chat("short", "one")) != prefix_key(chat("short", "two"))
    assert prefix_key(b'{"prompt": "abc"}') == prefix_key(b'{"prompt": "abc", "n": 1}')
    assert prefix_key(b"not json") is None
    assert prefix_key(b'{"messages": 3}') is None
    assert prefix_key(b"[1, 2]") is None


def test_affinity_keeps_a_prefix_on_one_member_until_it_is_overloaded():
    b = Balancer(BalanceOptions("least-loaded", "prefix"))
    members = [Load("a", service_s=0.1), Load("b", service_s=0.1), Load("c", service_s=0.1)]
    keys = [prefix_key(chat(f"system {i}", "q")) for i in range(60)]
    homes = {k: b.order("p", members, k)[0].name for k in keys}
    assert all(b.order("p", members, k)[0].name == homes[k] for k in keys)  # stable
    assert set(homes.values()) == {"a", "b", "c"}  # spread over the pool
    # a member leaving moves only its own keys
    without_c = [m for m in members if m.name != "c"]
    for k, home in homes.items():
        if home != "c":
            assert b.order("p", without_c, k)[0].name == home
    # an overloaded home gives its requests away
    k = keys[0]
    home = next(m for m in members if m.name == homes[k])
    home.in_flight = 50
    assert b.order("p", members, k)[0].name != home.name


def upstream(name: str, models: set[str], metrics: Metrics, weight: float = 1.0) -> Upstream:
    options = UpstreamOptions()  # never sent through: its transport stays unopened
    u = Upstream(
        UpstreamSpec(name, f"http://{name}.test", engine="vllm", weight=weight), options, metrics
    )
    u.routable = set(models)
    u.models = set(models)
    u.up = True
    return u


def test_pools_form_from_the_model_lists_and_refuse_when_every_member_is_down():
    metrics = Metrics()
    a, b, c = (upstream(n, {"m", n}, metrics) for n in ("a", "b", "c"))
    c.routable = c.models = {"other-model"}
    ups = Upstreams([a, b, c], BalanceOptions("round-robin"))
    assert ups.choose("m", b"")[0].name in ("a", "b")
    assert Counter(ups.choose("m", b"")[0].name for _ in range(10)) == {"a": 5, "b": 5}
    assert ups.choose("a", b"") == [a]  # one upstream: no pool
    ups.pools.publish()
    sample = metrics.registry.get_sample_value
    assert sample("phasewatch_pool_members", {"pool": "m"}) == 2
    a.eject("connect", "connection refused")
    assert sample("phasewatch_pool_members_up", {"pool": "m"}) == 1
    assert sample("phasewatch_upstream_ejections_total", {"upstream": "a", "kind": "connect"}) == 1
    assert [u.name for u in ups.choose("m", b"")] == ["b"]
    b.eject("http_5xx", "HTTP 500 on 3 requests in a row")
    with pytest.raises(PoolDown) as err:
        ups.choose("m", b"")
    assert "pool 'm'" in str(err.value) and "a: connection refused" in str(err.value)


def test_a_request_routes_on_the_whole_model_list_not_the_labelled_part():
    metrics = Metrics()
    u = upstream("o", set(), metrics)
    names = [f"copy-{i}:latest" for i in range(80)] + ["real:latest"]
    u.routable = set(names)
    u.models = u._labelled(names)
    assert len(u.models) == 64 and "real:latest" not in u.models
    assert u.serves("real:latest")
    # labelled names are kept while listed: new copies do not push them out
    before = set(u.models)
    u.models = u._labelled([f"new-{i}" for i in range(10)] + names)
    assert u.models == before


def test_the_prefix_hash_is_keyed_so_clients_cannot_aim_it():
    body = chat("a shared system prompt", "q")
    assert prefix_key(body, secret=b"s1") == prefix_key(body, secret=b"s1")
    keys = [
        (prefix_key(chat(f"p{i}", "q"), secret=b"s1"), prefix_key(chat(f"p{i}", "q"), secret=b"s2"))
        for i in range(50)
    ]
    assert all(a != b for a, b in keys)
    assert prefix_key(body, secret=b"x" * 100) == prefix_key(body, secret=b"x" * 100)  # long keys


def test_bounded_loads_spill_a_hot_prefix_over_the_pool():
    """160 requests of one prefix arriving while none finishes: the home takes up to its
    bound (1.25 x its share of the pool's load), the rest spill to the next member."""
    b = Balancer(BalanceOptions("least-loaded", "prefix"))
    members = [Load("a", service_s=0.1), Load("b", service_s=0.1)]
    key = prefix_key(chat("one shared prefix", "q"), secret=b"k")
    got = Counter()
    for _ in range(160):
        first = b.order("p", members, key)[0]
        first.in_flight += 1
        got[first.name] += 1
    assert max(got.values()) <= 100 and min(got.values()) >= 60, got
    # with a light load the prefix stays home
    for m in members:
        m.in_flight = 0
    home = b.order("p", members, key)[0].name
    assert all(b.order("p", members, key)[0].name == home for _ in range(20))
