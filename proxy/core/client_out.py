"""The answer to one client as the server lets the relay write it: at once, from any
callback (the upstream connection's included), with the client's flow and hang-up told
back by callbacks. The server offers it as the :data:`~proxy.extensions.CLIENT_OUT` ASGI
scope extension; the head and the last body message still go through ASGI ``send``.

Why: a stream's events then take one path, upstream read → tap → client write in the
upstream connection's callback, with no task hop per event; a client that stops reading
pauses the upstream connection's reading (``flow``), and the one hang-up detector is the
server's own ``connection_lost`` (``lost``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class ClientOut(Protocol):
    """One answer's body, written synchronously (see the module)."""

    #: The client's connection is lost: what is written is dropped.
    gone: bool
    #: The client reads slower than its answer comes (the server stopped writing to
    #: its socket's full buffers); writes are still taken and buffered.
    paused: bool

    def write(self, body: bytes, framed: bytes | None = None) -> None:
        """Write `body` as the answer's next body bytes, now: as one chunk of a chunked
        answer (`framed`, when given, is exactly that chunk's bytes, written as they
        are), as they are for an answer with a content-length, not at all for a HEAD
        answer or a gone client. Valid between the head (``http.response.start``) and
        the last body message (``more_body`` false); an empty `body` writes nothing."""
        ...

    def watch(
        self,
        lost: Callable[[], None] | None,
        flow: Callable[[bool], None] | None = None,
    ) -> None:
        """From now on, `lost()` is called once when the client's connection is lost
        before the answer's last message went (at once when it is gone already), and
        `flow(paused)` each time :attr:`paused` changes. ``watch(None, None)`` takes
        both back (the answer is complete, or the relay stops caring)."""
        ...
