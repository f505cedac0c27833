"""The hand-offs after a request's upstream write and after its answer's first body
write, while no other request is in flight.

Why: a write to a local socket wakes its reader on the writer's CPU (a sync wake-up: the
kernel expects the writer to wait next), so a client on the same machine waits for the
proxy to stop before it reads its first token, even with another CPU idle; through a burst
the proxy goes on with the rest of the stream first. Measured on a 2-vCPU box (``perf
sched``, 64-token streams at full speed, one at a time): the first token's reader was
queued on the proxy's CPU in 138 of 150 requests, and waited a median 290 us there.

So uvicorn's writes of an answer's head and first body go through :func:`arm`'s hand-off,
which then yields the CPU once (``os.sched_yield``), keeping that promise, and hands the
writes back. Only while the answer's request is the server's only one in flight: under
load the proxy gives no time away (``--no-handoff`` turns it off). The relay's own writes
(``proxy.runtime.direct``) never go through it: a paced event goes out with nothing after
it to wait for.

The same can happen one step earlier: the request's write to the engine may wake the engine
on the proxy's CPU (17 of 153 requests, same measurement; the others went to the idle one),
where it waits for the proxy to finish its turn. So the server also offers the relay
:func:`after_request`'s hand-off, called once the request is written upstream (the
``phasewatch.handoff`` extension, on the same terms): such an engine starts at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Collection
from typing import Any, Protocol

_yield = getattr(os, "sched_yield", lambda: None)


class Server(Protocol):
    """What the hand-off takes from the server's protocol."""

    @property
    def transport(self) -> Any:
        """The facade uvicorn's cycle writes through (its ``write`` is replaced)."""

    @property
    def real(self) -> asyncio.Transport | None:
        """The connection's own transport."""

    @property
    def tasks(self) -> Collection[object]:
        """The server's requests in flight."""


def arm(server: Server) -> None:
    """Route the next two writes through `server`'s facade (an answer's head, its first
    body) through the hand-off."""
    facade, real, in_flight = server.transport, server.real, server.tasks
    assert real is not None  # set when the connection was made
    left = 2

    def write(data: bytes) -> None:
        nonlocal left
        real.write(data)
        left -= 1
        if left == 0:
            facade.write = real.write
            if len(in_flight) <= 1:
                _yield()

    facade.write = write


def after_request(in_flight: Collection[object]) -> Callable[[], None]:
    """The hand-off after a request is written upstream: the CPU is yielded once, while
    that request is the only one of `in_flight` (the server's requests)."""

    def written() -> None:
        if len(in_flight) <= 1:
            _yield()

    return written
