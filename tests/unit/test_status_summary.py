"""The status page's summary is cached for up to a second (many pages may poll it), but
an upstream going down or coming back is in the very next summary, as it is in readiness
and the up gauge: a health answer must not contradict the others."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from proxy.fleet import Upstream, UpstreamOptions, Upstreams, UpstreamSpec
from proxy.measure.metrics import Metrics
from proxy.services.status import StatusPage


def _with_page(check: Callable[[Upstream, StatusPage], None]) -> None:
    """Run `check` on one upstream and the status page over it."""

    async def run() -> None:
        metrics = Metrics()
        spec = UpstreamSpec("eng", "http://127.0.0.1:9", engine="vllm")
        u = Upstream(spec, UpstreamOptions(), metrics)
        try:
            check(u, StatusPage(metrics, Upstreams([u])))
        finally:
            await u.aclose()

    asyncio.run(run())


def _row(page: StatusPage) -> dict:
    (row,) = page.summary()["upstreams"]
    return row


def test_an_upstream_state_change_is_in_the_next_summary():
    def check(u: Upstream, page: StatusPage) -> None:
        u._set_up(False, "connection refused")
        assert _row(page)["up"] is False and _row(page)["reason"] == "connection refused"
        u._set_up(True)  # back, well within the second the summary is cached for
        assert _row(page)["up"] is True and _row(page)["reason"] is None
        u._set_up(False, "timed out")
        assert _row(page)["up"] is False and _row(page)["reason"] == "timed out"

    _with_page(check)


def test_the_summary_is_still_cached_while_nothing_changes():
    def check(u: Upstream, page: StatusPage) -> None:
        u._set_up(True)
        assert page.summary() is page.summary()  # one computation serves both

    _with_page(check)
