"""A stream's events written from the upstream connection's callback (the push path).

Why: through the relay task, every event of a paced stream costs a task hop (the
upstream connection wakes the task through a future, a task step and three async
generators) before it is written, a large share of the proxy's CPU per paced event.
Where the upstream transport offers its body as it is parsed (the
``phasewatch.push`` response extension) and the server a synchronous writer (the
``phasewatch.write`` ASGI extension), each read goes through the tap and out to the
client in that callback, and the task wakes only for what the callback refuses.

Order is kept: while the task has bytes of its own to send it is ``busy`` and the sink
refuses (the connection keeps the bytes for the task); output the sink could not write
is ``held`` and goes out first, from the task. A client that is slow, gone, or whose
answer cannot take a chunk now is refused too, so the task's ``send`` (and its waiting)
handles it as before. An exception in the sink never reaches the transport: the push
path is given up for that stream (said once a while) and the task carries on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import httpx

from ..extensions import PUSH
from ..transport.connection import Sink
from .limited import LimitedLog

Feed = Callable[[bytes, float], bytes]
#: A tap's paced-read shortcut: `token(chunk, now)` is True when it counted `chunk` as
#: one event to forward as it came (``SSETap.token_read``).
Token = Callable[[bytes, float], bool]
Install = Callable[[Sink | None], None]


class Writer(NamedTuple):
    """The server's synchronous writer (the ``phasewatch.write`` extension's value)."""

    #: Whether a chunk of the answer can be written now, without waiting.
    ready: Callable[[], bool]
    #: `put(body, framed=None)`: write `body` as one chunk, right after `ready()` said
    #: yes; `framed` is `body` already framed as the answer's chunk (written as it is).
    put: Callable[..., None]
    #: `write(framed)`: what ``put(body, framed)`` does, given only `framed` (the
    #: server's own write, no Python frame of its own); None where the server has none.
    write: Callable[[bytes], None] | None = None


class Push:
    """One stream's sink, installed on its upstream connection (see the module)."""

    __slots__ = ("busy", "feed", "held", "install", "limited_log", "put", "ready", "token", "write")

    def __init__(
        self,
        install: Install,
        feed: Feed,
        writer: Writer,
        limited_log: LimitedLog,
        token: Token | None = None,
    ) -> None:
        self.install, self.feed, self.limited_log = install, feed, limited_log
        self.ready, self.put, self.write = writer
        #: The tap's shortcut for a paced read (``SSETap.token_read``), used with the
        #: server's own write where both exist: one Python call per such event.
        self.token = token
        self.busy = False
        self.held: list[bytes] = []

    @classmethod
    def of(
        cls,
        resp: httpx.Response,
        feed: Feed,
        writer: Writer | None,
        limited_log: LimitedLog,
        token: Token | None = None,
    ) -> Push | None:
        """The push path for `resp`'s body, installed; None where either side lacks it.
        `token`: the tap's paced-read shortcut, if it has one (see :class:`Push`)."""
        install = resp.extensions.get(PUSH)
        if writer is None or install is None:
            return None
        push = cls(install, feed, writer, limited_log, token)
        install(push.sink)
        return push

    def sink(self, chunk: bytes, framed: bytes | None = None) -> bool:
        """Feed `chunk` to the tap and write what it lets through; False (nothing taken)
        while the task is busy or holds output, or when the client cannot take it now.
        `framed` is `chunk` as one chunk of a chunked body (the upstream's, in the form
        the server writes): when the tap lets `chunk` through unchanged, that goes out."""
        if self.busy or self.held:
            return False
        out = None
        try:
            if not self.ready():
                return False
            now = time.monotonic()
            token, write = self.token, self.write
            if token is not None and write is not None and framed is not None and token(chunk, now):
                out = chunk  # counted: from here it is output, held if the write fails
                write(framed)
                return True
            out = self.feed(chunk, now)
            if out:  # nothing since ready() could have changed the answer's state
                self.put(out, framed if out is chunk else None)
        except Exception as exc:  # noqa: BLE001 - never into the transport's callback
            self._give_up(exc)
            if out is None:
                return False  # the tap never took it: the task feeds it
            self.held.append(out)
        return True

    def take(self) -> bytes:
        """The task is about to send (the sink refuses until it is done): the output the
        sink held, which goes out first."""
        self.busy = True
        held = self.held
        if not held:
            return b""
        out = b"".join(held)
        held.clear()
        return out

    def _give_up(self, exc: Exception) -> None:
        self.install(None)
        self.limited_log.warning(
            "push_failed",
            "the push path failed (%s); the stream goes on through the relay task",
            type(exc).__name__,
        )
