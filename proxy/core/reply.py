"""The answer to one client, and the client watched while it waits for it.

A client that hangs up cancels its exchange at once (which closes the upstream connection,
so the engine stops generating), unless its answer is already complete: the last message
of an answer goes out through :meth:`Reply.end` or :meth:`Reply.error`, which mark it
finished first, so a client that leaves after that has had its whole answer.

How the hang-up is seen: where the server offers it, through the ``phasewatch.gone``
ASGI extension (:data:`GONE`), a callback the server's protocol calls when the connection
is lost; elsewhere, a watcher task waiting on ASGI ``receive`` for ``http.disconnect``.
Why the extension: the watcher is one more task created, stepped and cancelled per
request, on the path before the upstream write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from .asgi import Receive, Send
from .errors import ErrorShape, send_error
from .headers import Headers
from .push import Writer

#: The ASGI scope extension of the server's hang-up hook (proxy.runtime.direct).
GONE = "phasewatch.gone"

#: The hook's value: ``watch(callback)`` has the server call `callback` once, from its
#: protocol, when the client's connection is lost before its answer is complete (at once
#: when it is lost already); ``watch(None)`` takes it back.
Watch = Callable[[Callable[[], None] | None], None]


class Reply:
    """What goes back to one client: its ASGI `send` (and the server's `writer` and hang-up
    hook `gone`, where it offers them), the headers every error of the proxy's own carries
    (`echo`: x-request-id with --echo-request-id), whether the last message went, and
    whether the client left before it."""

    __slots__ = (
        "_hooked",
        "_task",
        "_watcher",
        "disconnected",
        "echo",
        "finished",
        "gone",
        "send",
        "writer",
    )

    def __init__(
        self,
        send: Send,
        echo: Headers | None = None,
        writer: Writer | None = None,
        gone: Watch | None = None,
    ) -> None:
        self.send = send
        #: The server's synchronous writer (the ``phasewatch.write`` extension), if any.
        self.writer = writer
        #: The server's hang-up hook (the ``phasewatch.gone`` extension), if any.
        self.gone = gone
        self.echo: Headers = echo or []
        self.finished = False
        self.disconnected = False
        self._watcher: asyncio.Task[None] | None = None
        self._hooked = False
        self._task: asyncio.Task[None] | None = None

    async def end(self, body: bytes = b"") -> None:
        """The answer's last body message (the final send)."""
        self.finished = True
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def error(
        self,
        status: int,
        message: str,
        kind: str,
        headers: Headers | None = None,
        shape: ErrorShape | None = None,
    ) -> None:
        """The whole answer is an error of the proxy's own (OpenAI's shape unless `shape`
        gives the engine's for the path); `headers`, then the echo, go with it."""
        self.finished = True
        await send_error(self.send, status, message, kind, [*(headers or ()), *self.echo], shape)

    def watching(self, receive: Receive) -> _Watching:
        """Watch the client for the block's duration: when it hangs up before the answer
        is finished, the current task is cancelled; that cancellation ends the block
        quietly and leaves `disconnected` set."""
        return _Watching(self, receive)

    def unwatch(self) -> None:
        """Stop watching (from here on, a client that leaves cancels nothing)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if self._hooked:
            self._hooked = False
            assert self.gone is not None
            self.gone(None)

    def _hung_up(self) -> None:
        """The server says the client's connection is lost (the hook's callback)."""
        self._hooked = False
        if not self.finished and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    async def _watch(self, receive: Receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if not self.finished:
                    self.disconnected = True
                    assert self._task is not None
                    self._task.cancel()
                return


class _Watching:
    __slots__ = ("receive", "reply")

    def __init__(self, reply: Reply, receive: Receive) -> None:
        self.reply, self.receive = reply, receive

    async def __aenter__(self) -> Reply:
        reply = self.reply
        reply._task = asyncio.current_task()
        assert reply._task is not None
        if reply.gone is not None:
            reply._hooked = True
            reply.gone(reply._hung_up)
        else:
            reply._watcher = asyncio.create_task(reply._watch(self.receive))
        return reply

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        reply = self.reply
        reply.unwatch()
        if kind is not None and issubclass(kind, asyncio.CancelledError) and reply.disconnected:
            assert reply._task is not None
            reply._task.uncancel()
            return True  # the client left: not an error of ours
        return False
