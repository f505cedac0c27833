"""Stall detection's thresholds on real upstreams and exchanges, with the clock given:
what is a stall and, as much, what is not (a long prefill within its allowance, a request
queued behind streams that advance, a slow but steady decode)."""

from __future__ import annotations

import logging
from collections import Counter

from proxy.core.exchange import Exchange
from proxy.engines import Prepared
from proxy.fleet.balance import BalanceOptions
from proxy.fleet.upstream import Upstream, UpstreamOptions, UpstreamSpec
from proxy.fleet.upstreams import Upstreams
from proxy.measure.metrics import Metrics
from proxy.measure.timeline import Figures, Marks
from proxy.services.stall import BYTES_PER_TOKEN, FALLBACK_PREFILL_TPS, StallOptions, StallWatch

T0 = 1000.0


def upstream(name: str, metrics: Metrics) -> Upstream:
    options = UpstreamOptions()  # never sent through: its transport stays unopened
    u = Upstream(UpstreamSpec(name, f"http://{name}.test", engine="vllm"), options, metrics)
    u.routable = u.models = {"m"}
    u.up = True
    return u


def stream(u: Upstream, sent: float, prompt_bytes: int = 100, rid: str = "r") -> Exchange:
    ex = Exchange(
        rid,
        u,
        Prepared("chat", "m", True, b"x" * prompt_bytes),
        Marks(t_recv=sent, t_admit=sent, t_sent=sent),
        "m",
        "bf16",
    )
    u.active.add(ex)
    return ex


def learn(
    watch: StallWatch,
    u: Upstream,
    prefill_tps: float | None,
    itl: float | None,
    prompt_tokens: int = 100_000,
) -> None:
    """A finished request of `prompt_tokens` that taught the watch the upstream's rates."""
    ex = stream(u, T0 - 100)
    u.active.discard(ex)
    ex.marks.t_first = ex.marks.t_last = T0 - 90
    f = Figures(prompt_tokens=prompt_tokens)
    if prefill_tps is not None:
        f.prefill_tps["proxy"] = prefill_tps
    if itl is not None:
        f.tpot["proxy"] = itl
    watch.on_request(ex, f)


def setup(**options) -> tuple[StallWatch, Metrics, list[Upstream]]:
    metrics = Metrics()
    ups = [upstream(n, metrics) for n in ("a", "b")]
    fleet = Upstreams(ups, BalanceOptions("round-robin"))
    watch = StallWatch(StallOptions(**options), metrics, fleet)
    return watch, metrics, ups


def gauge(metrics: Metrics, name: str, upstream: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"upstream": upstream})


def test_a_stream_with_no_first_token_stalls_after_the_floor_and_is_counted_once(caplog):
    watch, metrics, (a, b) = setup(stall_floor=60.0)
    stream(a, T0, rid="req-1")
    watch.scan(T0 + 59)
    assert a.stalled == 0 and gauge(metrics, "phasewatch_stalled_streams", "a") == 0
    assert gauge(metrics, "phasewatch_stream_longest_silence_seconds", "a") == 59
    with caplog.at_level(logging.WARNING, "proxy.services.stall"):
        for t in (61, 70, 80):
            watch.scan(T0 + t)
    assert a.stalled == 1 and b.stalled == 0
    assert gauge(metrics, "phasewatch_stalled_streams", "a") == 1
    assert gauge(metrics, "phasewatch_stream_longest_silence_seconds", "a") == 80
    assert a.stall_reason and "1 stream(s) stalled" in a.stall_reason
    counted = metrics.registry.get_sample_value(
        "phasewatch_stalls_total", {"upstream": "a", "phase": "prefill"}
    )
    assert counted == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "req-1" in lines[0] and "upstream a" in lines[0]


def test_a_long_prompt_gets_its_prefill_allowance():
    watch, _, (a, _b) = setup(stall_floor=60.0, stall_prefill_factor=4.0)
    learn(watch, a, prefill_tps=5000.0, itl=0.02)
    tokens = 100_000
    stream(a, T0, prompt_bytes=int(tokens * 4))  # about 4 bytes a token in the body
    allowed = 4.0 * (tokens * 4 / BYTES_PER_TOKEN) / 5000.0
    assert allowed > 100  # 100K tokens at 5,000 tok/s take 20 s: five times that allowed
    watch.scan(T0 + allowed - 1)
    assert a.stalled == 0
    watch.scan(T0 + allowed + 1)
    assert a.stalled == 1


def test_a_rate_learnt_on_short_prompts_does_not_judge_a_long_one():
    watch, _, (a, _b) = setup(stall_floor=3.0, stall_prefill_factor=4.0)
    for _ in range(3):  # tiny prompts, prefilled at once: a very fast rate
        learn(watch, a, prefill_tps=500_000.0, itl=0.02, prompt_tokens=1000)
    stream(a, T0, prompt_bytes=400_000)  # some 100k tokens: a band not measured yet
    watch.scan(T0 + 60)  # the tiny prompts' rate would allow it about 3 s
    assert a.stalled == 0
    # the slow fallback rate for it, until its band is measured
    allowed = 4.0 * (400_000 / BYTES_PER_TOKEN) / FALLBACK_PREFILL_TPS
    watch.scan(T0 + allowed - 1)
    assert a.stalled == 0
    watch.scan(T0 + allowed + 1)
    assert a.stalled == 1
    # a short prompt is judged by the short prompts' rate (and the floor)
    b_watch, _, (c, _d) = setup(stall_floor=3.0)
    learn(b_watch, c, prefill_tps=500_000.0, itl=0.02, prompt_tokens=1000)
    stream(c, T0, prompt_bytes=3000)
    b_watch.scan(T0 + 4)
    assert c.stalled == 1


def test_a_stream_its_client_holds_back_is_not_stalled_and_counted_apart():
    watch, metrics, (a, _b) = setup(stall_floor=10.0)
    ex = stream(a, T0)
    ex.marks.t_first = ex.marks.t_last = T0 + 1
    ex.client_flow(True, T0 + 2)  # the client stopped reading
    watch.scan(T0 + 100)
    assert a.stalled == 0 and gauge(metrics, "phasewatch_client_held_streams", "a") == 1
    assert not metrics.registry.get_sample_value(
        "phasewatch_stalls_total", {"upstream": "a", "phase": "decode"}
    )
    # a request queued beside it is not taken for a stall of a silent engine either
    stream(a, T0 + 50, rid="queued")
    watch.scan(T0 + 100)
    assert a.stalled == 0
    a.active.clear()
    a.active.add(ex)
    # caught up: its silence counts from then
    ex.client_flow(False, T0 + 100)
    watch.scan(T0 + 109)
    assert a.stalled == 0 and gauge(metrics, "phasewatch_client_held_streams", "a") == 0
    watch.scan(T0 + 111)
    assert a.stalled == 1


def test_a_request_queued_behind_streams_that_advance_is_not_stalled():
    watch, _, (a, _b) = setup(stall_floor=60.0)
    stream(a, T0, rid="queued")
    busy = stream(a, T0, rid="busy")
    busy.marks.t_first = T0 + 1
    busy.marks.t_last = T0 + 170  # generating all along
    watch.scan(T0 + 171)
    assert a.stalled == 0
    busy.marks.t_last = T0 + 100  # the other stream stopped too: the engine is silent
    watch.scan(T0 + 171)
    assert a.stalled == 2


def test_after_the_first_token_many_gaps_at_the_measured_decode_rate():
    watch, metrics, (a, _b) = setup(stall_floor=10.0, stall_gaps=100.0)
    learn(watch, a, prefill_tps=None, itl=0.5)  # a slow engine: 2 tok/s, 50 s allowed
    ex = stream(a, T0)
    ex.marks.t_first = T0 + 1
    # a steady decode: an event every half second for ten minutes never stalls
    for i in range(1200):
        ex.marks.t_last = T0 + 1 + 0.5 * i
        if i % 50 == 0:
            watch.scan(ex.marks.t_last + 0.4)
            assert a.stalled == 0
    watch.scan(ex.marks.t_last + 49)
    assert a.stalled == 0
    watch.scan(ex.marks.t_last + 51)
    assert a.stalled == 1
    assert metrics.registry.get_sample_value(
        "phasewatch_stalls_total", {"upstream": "a", "phase": "decode"}
    )
    # output again: no longer stalled
    ex.marks.t_last += 52
    watch.scan(ex.marks.t_last + 1)
    assert a.stalled == 0 and a.stall_reason is None


def test_a_pool_sends_new_requests_to_members_without_stalled_streams():
    watch, _, (a, b) = setup(stall_floor=5.0)
    ups = watch.upstreams
    assert Counter(ups.choose("m", b"")[0].name for _ in range(10)) == {"a": 5, "b": 5}
    stream(a, T0)
    watch.scan(T0 + 6)
    assert Counter(ups.choose("m", b"")[0].name for _ in range(10)) == {"b": 10}
    b.stalled = 1  # every member stalled: the pool still serves
    assert Counter(ups.choose("m", b"")[0].name for _ in range(10)) == {"a": 5, "b": 5}


def test_non_streamed_and_finished_requests_are_not_streams_in_flight():
    watch, _, (a, _b) = setup(stall_floor=5.0)
    ex = stream(a, T0)
    ex.prepared = Prepared("chat", "m", False, b"x")
    watch.scan(T0 + 100)
    assert a.stalled == 0
    ex.prepared = Prepared("chat", "m", True, b"x")
    ex.marks.t_end = T0 + 1
    watch.scan(T0 + 100)
    assert a.stalled == 0


def test_with_the_defaults_a_steady_100_second_generation_is_never_stalled():
    watch, _, (a, _b) = setup()  # --stall-floor 60, --stall-prefill-factor 4, --stall-gaps 100
    assert watch.options == StallOptions(60.0, 4.0, 100.0)
    ex = stream(a, T0, prompt_bytes=8000)  # a 2K-token prompt, nothing measured yet
    ex.marks.t_first = ex.marks.t_last = T0 + 3
    t = T0 + 3
    while t < T0 + 103:  # an event every 1.5 s: slow, steady
        for now in (t + 0.5, t + 1.0, t + 1.49):
            watch.scan(now)
            assert a.stalled == 0, now - T0
        t += 1.5
        ex.marks.t_last = t
    watch.scan(t + 59)
    assert a.stalled == 0
    watch.scan(t + 61)  # then silence past the floor: stalled
    assert a.stalled == 1
