"""How many bytes of request bodies the proxy holds at once, and a bounded body reader.

Each request body is read whole before it goes upstream (the route and the measurement
depend on it) and stays referenced until its exchange ends. Without a bound, a few
clients sending large bodies at once would take the process's memory; with
:class:`BodyBudget` a request whose body does not fit gets a 503 with ``Retry-After``
instead, and nothing else is disturbed. A body is held once: each piece is copied into
one growing buffer as it arrives (a few microseconds of the event loop each), and that
buffer becomes the body without another copy. Joining the pieces at the end would hold
the body twice for the copy's length, past what the budget counted.

The budget counts bytes as they arrive, not what a ``Content-Length`` promises: a client
cannot hold the budget with a header alone. And a body that stops arriving is given up
after a stall deadline, so stalled uploads cannot hold what they sent for ever.
"""

from __future__ import annotations

import asyncio
import io

from .asgi import Receive


class ClientGone(Exception):
    """The client disconnected while its request body was being read."""


class TooLarge(Exception):
    """The body is over the per-request limit (413)."""


class OverBudget(Exception):
    """The body does not fit in what is left of the memory budget (503)."""


class Stalled(Exception):
    """No byte of the body arrived within the stall deadline (408)."""


class BodyBudget:
    """Bytes of request bodies held at once, against one limit (per process)."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        """Reserve `n` bytes; False (and nothing reserved) when they do not fit."""
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class Body:
    """One request body, read against the per-request limit and the shared budget.
    ``reserved`` is what it holds of the budget: give it back with :meth:`release`."""

    __slots__ = ("budget", "reserved")

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.reserved = 0

    def reserve(self, n: int) -> None:
        if n > self.reserved:
            if not self.budget.take(n - self.reserved):
                raise OverBudget()
            self.reserved = n

    async def read(self, receive: Receive, limit: int, declared: int | None, stall: float) -> bytes:
        """The whole body, at most `limit` bytes (`declared`: its Content-Length, refused
        at once when over), each piece reserved as it arrives; :class:`Stalled` when
        `stall` seconds pass without one."""
        if declared is not None and declared > limit:
            raise TooLarge()
        first = b""  # a body of one piece (nearly all) is that piece, not a copy
        held: io.BytesIO | None = None
        size = 0
        guard = _StallGuard(stall)
        try:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise ClientGone()
                chunk = msg.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise TooLarge()
                    self.reserve(size)
                    if held is not None:
                        held.write(chunk)
                    elif first:
                        held = io.BytesIO()
                        held.write(first)
                        held.write(chunk)
                        first = b""
                    else:
                        first = chunk
                if not msg.get("more_body", False):
                    # (a BytesIO hands over its buffer, uncopied, when nothing else
                    # shares it)
                    return first if held is None else held.getvalue()
                guard.progress()
        except asyncio.CancelledError:
            if guard.expired():
                raise Stalled() from None
            raise
        finally:
            guard.cancel()

    def release(self) -> None:
        self.budget.give(self.reserved)
        self.reserved = 0


class _StallGuard:
    """Cancels the reading task once `stall` seconds pass without progress.

    Why not ``asyncio.timeout``: a body nearly always arrives with its head, and the
    guard is set up for every request; one timer that looks at the last progress when it
    fires is cheaper than a deadline moved on every piece."""

    __slots__ = ("_fired", "_handle", "_last", "_loop", "_stall", "_task")

    def __init__(self, stall: float) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._stall = stall
        self._last = now = loop.time()
        self._fired = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(now + stall, self._check)

    def progress(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self._stall
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._handle = None
        self._fired = True
        if self._task is not None:
            self._task.cancel()

    def expired(self) -> bool:
        """Whether the guard cancelled the task (and the cancellation is its alone)."""
        return self._fired and self._task is not None and self._task.uncancel() == 0

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
