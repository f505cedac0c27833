"""Admission: a measured exchange's place at its upstream's gate, held while it lives.

``async with Admitted(metrics, ex):`` waits at the upstream's gate (in the queued gauge
while it waits), then holds the place until the block ends, however it ends: the
exchange is in the upstream's active set (the power sampler reads it from its thread)
and in the in-flight gauge. A request that could not be sent at all moves to another
member of its pool (:meth:`Admitted.move`): released here, admitted there through that
member's own gate. A gate that refuses raises QueueFull or QueueTimeout out of the
``async with``; :func:`queue_refusal` says what the client gets.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING

from ..fleet.gate import QueueFull, QueueTimeout
from .refusals import RETRY_AFTER, Refusal

if TYPE_CHECKING:
    from ..fleet.upstream import Upstream
    from ..measure.metrics import Metrics
    from .errors import UpstreamFailure
    from .exchange import Exchange


class Admitted:
    """One exchange's place at its upstream's gate (see the module's docstring)."""

    __slots__ = ("_in_flight", "_queued", "ex", "held", "metrics")

    def __init__(self, metrics: Metrics, ex: Exchange) -> None:
        self.metrics = metrics
        self.ex = ex
        #: Whether the place is held now (the gate's slot, the active set, the gauge).
        self.held = False
        self._bind()

    def _bind(self) -> None:
        ex = self.ex
        base = (ex.upstream.name, ex.model_label, ex.precision)
        self._queued = self.metrics.queued_requests.labels(*base)
        self._in_flight = self.metrics.in_flight_requests.labels(*base)

    async def _take(self) -> None:
        upstream = self.ex.upstream
        self._queued.inc()
        try:
            await upstream.gate.acquire(self.ex.owner)
        finally:
            self._queued.dec()
        self.held = True
        upstream.active.add(self.ex)
        by_model = upstream.active_by_model
        self.ex.batch = by_model[self.ex.model_label] = by_model.get(self.ex.model_label, 0) + 1
        self._in_flight.inc()

    def _leave(self) -> None:
        if self.held:
            self.held = False
            upstream = self.ex.upstream
            upstream.active.discard(self.ex)
            by_model = upstream.active_by_model
            left = by_model.get(self.ex.model_label, 1) - 1
            if left > 0:
                by_model[self.ex.model_label] = left
            else:
                by_model.pop(self.ex.model_label, None)
            upstream.gate.release()
            self._in_flight.dec()

    async def __aenter__(self) -> Admitted:
        await self._take()
        self.ex.marks.t_admit = time.monotonic()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._leave()

    async def move(self, nxt: Upstream, failure: UpstreamFailure) -> None:
        """The request never reached its upstream (`failure`): counted as a pool retry,
        released here, relabelled and admitted at `nxt`. When `nxt`'s gate refuses too,
        the client gets the first failure (raised again)."""
        ex = self.ex
        self._leave()
        self.metrics.pool_retries_total.labels(ex.upstream.model_label(ex.prepared.model)).inc()
        ex.upstream = nxt
        ex.model_label = nxt.model_label(ex.prepared.model)
        ex.precision = nxt.precision_of(ex.model_label).precision
        self._bind()
        try:
            await self._take()
        except (QueueFull, QueueTimeout):
            raise failure from None


def queue_refusal(upstream: Upstream, exc: QueueFull | QueueTimeout) -> Refusal:
    """What a client refused at `upstream`'s gate gets, and the line said of it."""
    gate = upstream.gate
    if isinstance(exc, QueueFull):
        return Refusal(
            429,
            f"upstream {upstream.name} queue is full ({gate.max_queue} waiting); retry later",
            "rate_limit_exceeded",
            "queue_full",
            "upstream %s: %d requests running and %d waiting (--max-concurrency, "
            "--max-queue); refused with 429",
            (upstream.name, gate.limit, gate.max_queue),
            RETRY_AFTER,
        )
    return Refusal(
        503,
        f"waited {gate.timeout:g}s in the queue for upstream {upstream.name}",
        "queue_timeout",
        "queue_timeout",
        "upstream %s: a request waited %gs in the queue (--queue-timeout); refused with 503",
        (upstream.name, gate.timeout),
        RETRY_AFTER,
    )
