"""The admission gate: at most N generation requests in flight per upstream, a bounded
FIFO queue behind them."""

from __future__ import annotations

import asyncio
import collections


class QueueFull(Exception):
    """The admission queue is at its bound: answer 429."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout: answer 503."""


class AdmissionGate:
    """At most `limit` requests in flight; up to `max_queue` more wait in FIFO order.

    With limit 0 the gate admits everything at once (t_admit = t_recv).
    """

    def __init__(self, limit: int, max_queue: int, timeout: float) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout = timeout
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.limit <= 0 or (self.active < self.limit and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise QueueFull()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            if self.timeout > 0:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout)
            else:
                await fut
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():  # admitted while giving up: pass it on
                self._release_slot()
            else:
                fut.cancel()
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, asyncio.TimeoutError):
                raise QueueTimeout() from None
            raise

    def release(self) -> None:
        if self.limit <= 0:
            self.active -= 1
            return
        self._release_slot()

    def _release_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter
                return
        self.active -= 1
