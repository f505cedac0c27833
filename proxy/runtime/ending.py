"""How a guarded connection ends: two fixes to uvicorn's protocol, mixed into the guarded
protocol (:class:`proxy.runtime.protocol.GuardedProtocol`).

- **half-close**: a client that half-closes (sends FIN) after a complete request still
  gets its answer. Whether it is still there or gone cannot be told from a FIN alone, so
  the server sends an interim ``100 Continue`` (every HTTP/1.1 client must skip 1xx
  answers it did not expect): a client that closed its socket answers it with a reset,
  and its request is cancelled as a hang-up, as before;
- **lingering close**: when the server answers before it has read the whole request
  body (413, 401, 431 ...) and the connection is to close, closing at once would reset
  the connection under the client's feet and lose the answer. The server half-closes
  instead and reads and drops what the client still sends, for up to
  ``--header-timeout``, then closes.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

#: After a client's FIN, when to look for its reset (seconds after the probe), then
#: every second until its answer starts.
_PEER_CHECKS = (0.002, 0.01, 0.05, 0.2, 1.0)


class ConnectionEnd:
    """Half-close and lingering close, for the guarded protocol. The state is the
    protocol's (set in its ``__init__``; the timers cancelled in its ``connection_lost``),
    declared here for what these methods read and write."""

    # uvicorn's protocol
    transport: asyncio.Transport
    cycle: RequestResponseCycle
    loop: asyncio.AbstractEventLoop
    scope: Any
    pipeline: deque
    # the guarded protocol's
    real: asyncio.Transport | None
    header_timeout: float
    head_timer: asyncio.TimerHandle | None
    lingering: bool
    linger_timer: asyncio.TimerHandle | None
    peer_timer: asyncio.TimerHandle | None
    peer_checks: int
    eof_seen: bool

    def eof_received(self) -> bool | None:
        """The client sent FIN: a hang-up, or a half-close after its request."""
        if self.eof_seen:
            return True  # told again (some loops do, when reading resumes): known
        self.eof_seen = True
        cycle = self.cycle
        if (
            self.lingering
            or cycle is None
            or cycle.more_body
            or cycle.response_started
            or self.pipeline
        ):
            # a hang-up (it cancels the request, as before). Once the answer has started
            # nothing harmless can be sent to tell a half-close from a hang-up; a client
            # that half-closes does so right after its request, before any answer.
            return None
        # the whole request is in and its answer has not started: keep the connection for
        # writing, and find out whether the client is still there to read it
        cycle.keep_alive = False
        if self.scope.get("http_version") == "1.1":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.peer_checks = 0
        self._schedule_peer_check()
        return True

    def close_connection(self) -> None:
        """uvicorn closes the connection: linger while the client is still sending."""
        assert self.real is not None
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not self.lingering:
            self._linger()
        else:
            self.real.close()

    def _linger(self) -> None:
        """Half-close: the client reads the answer and its end; what it still sends is
        dropped until it closes too, or for up to header_timeout."""
        real = self.real
        assert real is not None
        self.lingering = True
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if real.is_closing():
            return
        if real.can_write_eof():
            real.write_eof()
        real.resume_reading()
        self.linger_timer = self.loop.call_later(self.header_timeout, real.close)

    def _schedule_peer_check(self) -> None:
        delay = _PEER_CHECKS[min(self.peer_checks, len(_PEER_CHECKS) - 1)]
        self.peer_timer = self.loop.call_later(delay, self._check_peer)

    def _check_peer(self) -> None:
        """After the client's FIN: a reset means it is gone (a hang-up)."""
        self.peer_timer = None
        real = self.real
        if real is None or real.is_closing() or self.cycle is None:
            return
        if self.cycle.response_started:
            return  # the answer's own writes fail if the client is gone
        sock = real.get_extra_info("socket")
        try:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock else 0
        except OSError:
            err = 1
        if err:
            real.abort()  # the request is cancelled as a hang-up
            return
        self.peer_checks += 1
        self._schedule_peer_check()
