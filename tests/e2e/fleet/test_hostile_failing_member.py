"""A pool member that fails fast does not take the pool's traffic.

One healthy member (answers after a short while) beside one that fails at once:
- answering 429 with ``Retry-After: 1``: it is held back for that second each time, so
  it gets at most the requests its Retry-After allows (about one per second per client),
  not the lion's share its short answers used to win under least-loaded;
- answering 500: three in a row eject it; its probe passing is not enough to come back:
  one real request at a time is let through (half-open) after a jittered backoff, and
  each that fails ejects it again;
- sending its head and then nothing: read timeouts count as failures, so it is ejected
  the same way rather than kept up until each request's timeout.
Every request sent to a failing member is counted at that member (the FakeEngine's own
log), and compared with what its Retry-After or the ejections allow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import time

import httpx

from ...support.fake_engine import FakeEngine, Reply, completion, json_response, response
from ...support.servers import start_proxy

MODEL = "m"
CLIENTS = 8


def good_engine(delay: float = 0.02) -> FakeEngine:
    async def script(req, reader, writer):
        await asyncio.sleep(delay)
        writer.write(json_response(200, completion(MODEL)))
        await writer.drain()

    return FakeEngine(models=[MODEL], script=script).start()


def run(proxy, n: int) -> tuple[list[int], float]:
    """`n` chat requests from CLIENTS concurrent clients: their statuses, the seconds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def one(_: int) -> int:
        try:
            return httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30).status_code
        except httpx.HTTPError:
            return 0

    started = time.monotonic()
    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        codes = list(pool.map(one, range(n)))
    return codes, time.monotonic() - started


def trials(took: float, each: float = 0.0) -> int:
    """The trial requests (half-open) a failing member may get in `took` s: one per
    ejection, each ejection holding it 0.25, 0.5, 1, then 2 s (--eject-backoff-max 2),
    jittered by at most -25 %, and each trial taking `each` s to fail."""
    return 4 + int(took / (2.0 * 0.75 + each))


def sent(engine: FakeEngine) -> int:
    return sum(1 for r in engine.posts() if r.target.startswith("/v1/chat"))


def pool_of(bad: FakeEngine, good: FakeEngine, *extra: str):
    return start_proxy(
        f"bad={bad.url}",
        f"good={good.url}",
        args=["--engine", "bad=openai", "--engine", "good=openai", "--engine-scrape", "0", *extra],
    )


def test_a_member_answering_429_gets_what_its_retry_after_allows():
    too_many = json_response(429, {"error": {"message": "slow down"}})
    too_many = too_many.replace(b"\r\n\r\n", b"\r\nRetry-After: 1\r\n\r\n", 1)
    bad = FakeEngine(
        models=[MODEL], answer=lambda r: Reply(too_many) if r.method == "POST" else None
    ).start()
    good = good_engine()
    proxy = pool_of(bad, good)
    try:
        codes, took = run(proxy, 400)
        n_bad = sent(bad)
        allowed = (int(took / 1.0) + 1) * CLIENTS  # one per client per Retry-After window
        print(f"429 member: {n_bad} of 400 ({n_bad / 4:.1f} %) in {took:.1f}s, allowed {allowed}")
        assert codes.count(429) == n_bad and codes.count(200) == 400 - n_bad
        assert n_bad <= allowed and n_bad <= 200, (n_bad, allowed)
    finally:
        proxy.stop()
        bad.stop()
        good.stop()


def test_a_member_answering_500_stays_out_until_real_traffic_succeeds():
    bad = FakeEngine(models=[MODEL], fail=True)
    bad.fail = False  # its model list answers: it joins the pool, then fails every POST
    bad.answer = lambda r: (
        Reply(json_response(500, {"error": "broken"})) if r.method == "POST" else None
    )
    bad.start()
    good = good_engine()
    # holds capped at 2 s (the default cap, 30 s, is tested in test_hostile_fourth_members):
    # the recovered member's next trial comes within the second run below
    proxy = pool_of(bad, good, "--health-interval", "0.1", "--eject-backoff-max", "2")
    try:
        codes, took = run(proxy, 400)
        n_bad = sent(bad)
        # 3 in a row eject it; then one trial per backoff (0.25 s doubling, jitter -25 %)
        allowed = CLIENTS + trials(took)  # a request per client before 3 in a row, trials
        print(f"500 member: {n_bad} of 400 ({n_bad / 4:.1f} %) in {took:.1f}s, allowed {allowed}")
        assert codes.count(500) == n_bad
        assert n_bad <= allowed, (n_bad, allowed)
        # healthy again: real traffic brings it back
        bad.answer = None
        codes, _ = run(proxy, 200)
        assert codes == [200] * 200
        assert sent(bad) > n_bad + 20, "a member that recovered gets traffic again"
    finally:
        proxy.stop()
        bad.stop()
        good.stop()


def test_a_member_that_sends_a_head_and_hangs_is_ejected_by_its_timeouts():
    head = response(200, b"", [("content-type", "application/json")], length=100)
    bad = FakeEngine(
        models=[MODEL], answer=lambda r: Reply(head, then="hang") if r.method == "POST" else None
    ).start()
    good = good_engine()
    proxy = pool_of(bad, good, "--read-timeout", "2")
    try:
        codes, took = run(proxy, 400)
        n_bad = sent(bad)
        allowed = CLIENTS + trials(took, each=2.0)  # a trial fails at its read timeout
        failed = 400 - codes.count(200)
        print(f"head-then-hang member: {n_bad} sent to it, {failed} failed, allowed {allowed}")
        assert n_bad <= allowed and failed <= allowed, (n_bad, failed, allowed)
    finally:
        proxy.stop()
        bad.stop()
        good.stop()
