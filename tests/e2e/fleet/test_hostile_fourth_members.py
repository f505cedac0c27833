"""Finding 5 of the fourth hostile pass, the failing member: a pool member whose health
probe answers but whose every generation answers 500 still failed some 9 % of a light
load's requests: each ejection held it out at most ``--health-backoff-max`` (2 s), after
which one real request was let through on trial, and failed. A 500 cannot be retried
elsewhere (bytes reached an engine), so the only lever is how often the member is tried:
each trial that fails now doubles its hold up to ``--eject-backoff-max`` (30 s).

Two clients, a healthy member answering in 0.1 s and the broken one, for 30 s of
traffic; the requests sent to the broken member are counted at that member (the fake
engine's own log) and compared with the trials the backoff allows.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx

from ...support.fake_engine import FakeEngine, Reply, json_response
from ...support.servers import metric_samples, sample
from .test_hostile_failing_member import MODEL, good_engine, pool_of, sent

CLIENTS = 2
SECONDS = 30.0


def _trials_allowed(took: float, cap: float) -> int:
    """Trials in `took` s: holds of 0.25 s doubling up to `cap`, each jittered by at most
    -25 %; plus a request per client before three in a row ejected it."""
    n, t, hold = 0, 0.0, 0.25
    while t <= took:
        t += hold * 0.75
        n += 1
        hold = min(hold * 2, cap)
    return n + CLIENTS + 1


def test_a_member_answering_500_is_tried_less_and_less():
    bad = FakeEngine(models=[MODEL])
    bad.answer = lambda r: (
        Reply(json_response(500, {"error": "broken"})) if r.method == "POST" else None
    )
    bad.start()
    good = good_engine(delay=0.1)
    proxy = pool_of(bad, good, "--health-interval", "0.1")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        stop = time.monotonic() + SECONDS

        def client(_: int) -> list[int]:
            codes = []
            with httpx.Client(timeout=30) as c:
                while time.monotonic() < stop:
                    codes.append(c.post(proxy.url + "/v1/chat/completions", json=body).status_code)
            return codes

        started = time.monotonic()
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            codes = [c for got in pool.map(client, range(CLIENTS)) for c in got]
        took = time.monotonic() - started
        n_bad = sent(bad)
        share = 100 * n_bad / len(codes)
        allowed = _trials_allowed(took, 30.0)
        ejections = sample(
            metric_samples(proxy.url), "phasewatch_upstream_ejections_total", upstream="bad"
        )
        print(
            f"500 member: {n_bad} of {len(codes)} requests ({share:.1f} %) in {took:.0f} s, "
            f"{ejections:.0f} ejections; the backoff allows {allowed}"
        )
        assert codes.count(500) == n_bad
        assert n_bad <= allowed, (n_bad, allowed)
    finally:
        proxy.stop()
        bad.stop()
        good.stop()
