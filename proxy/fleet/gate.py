"""The admission gate: at most N generation requests in flight per upstream, a bounded
FIFO queue behind them.

The queue is shared by every client, so it is fair between them: when it is full, a
newcomer whose client (its API key's name, else its address) waits with fewer requests
than the client waiting with the most takes the place of that client's newest waiter
(which gets the QueueFull); only a newcomer of the client holding the most is refused."""

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
        #: (the waiter, its client), oldest first
        self._waiters: collections.deque[tuple[asyncio.Future[None], str]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, owner: str = "") -> None:
        """Wait for a place; `owner` names the client (the queue's fairness)."""
        if self.limit <= 0 or (self.active < self.limit and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= self.max_queue:
            self._make_room(owner)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((fut, owner))
        try:
            if self.timeout > 0:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout)
            else:
                await fut
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # admitted while giving up: pass it on
                self._release_slot()
            else:
                fut.cancel()
                try:
                    self._waiters.remove((fut, owner))
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

    def _make_room(self, owner: str) -> None:
        """The queue is full: the newest waiter of the client waiting with the most gives
        its place up (QueueFull) to `owner`, who waits with fewer; else QueueFull."""
        counts: collections.Counter[str] = collections.Counter(o for _, o in self._waiters)
        top, most = counts.most_common(1)[0] if counts else ("", 0)
        if self.max_queue <= 0 or counts[owner] + 1 >= most:
            raise QueueFull()
        for entry in reversed(self._waiters):
            if entry[1] == top:
                self._waiters.remove(entry)
                if not entry[0].done():
                    entry[0].set_exception(QueueFull())
                return
        raise QueueFull()

    def _release_slot(self) -> None:
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes straight to the next waiter
                return
        self.active -= 1
