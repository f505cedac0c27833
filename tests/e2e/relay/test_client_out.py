"""The answer's ClientOut as the server offers it (proxy.runtime.cycle, the
``phasewatch.client_out`` extension), on the real guarded protocol over loopback: a
write goes out at once, framed as a chunk of a chunked answer, or as raw bytes counted
off a content-length (the last ``send`` then finds the length met), never
for HEAD; the client's flow is told (``flow``) as the connection's writing pauses and
resumes; its hang-up is told once (``lost``), never after the watch is taken back, and a
reply watching through it needs no task; a finished answer's cycle needs no collector."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
import weakref
from collections.abc import AsyncIterator

import uvicorn

from proxy.core.answer import Reply
from proxy.extensions import CLIENT_OUT
from proxy.runtime.http1 import guarded_protocol

from ...support.servers import free_port


def _serve(app, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(64 * 1024, 10.0, lambda reason: None),
        lifespan="off",
        log_config=None,
    )
    return uvicorn.Server(config)


@contextlib.asynccontextmanager
async def served(app) -> AsyncIterator[int]:
    """`app` served on a loopback port (yielded) by uvicorn with the guarded protocol."""
    port = free_port()
    server = _serve(app, port)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def _leave_after_head(port: int, done: asyncio.Event, path: bytes = b"/") -> None:
    """A GET of `path` whose client reads the answer's head and leaves; returns once the
    application has set `done`."""
    reader, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    w.close()
    await asyncio.wait_for(done.wait(), 30)


def exchange(port: int, request: bytes) -> bytes:
    """`request` sent on a new connection; the answer read to its chunked end (a HEAD
    answer: to its head)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while not out.endswith(b"0\r\n\r\n") and not (
            request.startswith(b"HEAD") and out.endswith(b"\r\n\r\n")
        ):
            got = s.recv(65536)
            if not got:
                break
            out += got
        return out


def test_a_chunked_answer_takes_writes_framed_in_order_with_send():
    seen: list[tuple[str, str]] = []

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        method = scope["method"]
        try:
            out.write(b"early")
        except RuntimeError:
            seen.append((method, "refused before the head"))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        out.write(b"written ")
        out.write(b"framed ", b"7\r\nframed \r\n")
        out.write(b"")  # nothing
        await send({"type": "http.response.body", "body": b"sent", "more_body": False})
        out.write(b"after the end")  # the answer is complete: dropped
        seen.append((method, "done"))

    async def main() -> tuple[bytes, bytes]:
        async with served(app) as port:
            get = await asyncio.to_thread(exchange, port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = await asyncio.to_thread(exchange, port, b"HEAD / HTTP/1.1\r\nhost: x\r\n\r\n")
        return get, head

    get, head = asyncio.run(main())
    assert get.split(b"\r\n\r\n", 1)[1] == (
        b"8\r\nwritten \r\n7\r\nframed \r\n4\r\nsent\r\n0\r\n\r\n"
    ), get
    assert head.endswith(b"\r\n\r\n") and b"written" not in head
    # a HEAD answer takes no body at all, whenever it is written
    assert seen == [
        ("GET", "refused before the head"),
        ("GET", "done"),
        ("HEAD", "refused before the head"),
        ("HEAD", "done"),
    ]


def test_a_content_length_answer_takes_raw_bytes_counted_off_its_length():
    errors: list[str] = []

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        headers = [(b"content-length", b"10")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        out.write(b"hello")
        try:
            out.write(b"too long!")
        except RuntimeError as exc:
            errors.append(str(exc))
        out.write(b"world")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def fetch(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            out = b""
            while not out.endswith(b"helloworld"):
                got = s.recv(65536)
                if not got:
                    break
                out += got
            return out

    async def main() -> bytes:
        async with served(app) as port:
            return await asyncio.to_thread(fetch, port)

    got = asyncio.run(main())
    assert got.split(b"\r\n\r\n", 1)[1] == b"helloworld", got
    assert b"content-length: 10" in got.lower() and b"chunked" not in got.lower()
    assert errors == ["Response content longer than Content-Length"]


def test_the_clients_flow_is_told_as_writing_pauses_and_resumes():
    """A client that does not read: writes are still taken, `paused` turns true and
    `flow(True)` is called; once it reads everything, `flow(False)`."""
    flows: list[bool] = []
    state: dict[str, object] = {}
    resumed = asyncio.Event()

    def flow(paused: bool) -> None:
        flows.append(paused)
        if not paused:
            resumed.set()

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        out.watch(lambda: None, flow)
        piece = b"x" * 65536
        written = 0
        while not out.paused and written < 256 * 1024 * 1024:
            out.write(piece)  # taken, buffered past the high-water mark
            written += len(piece)
        state["paused at"] = written
        state["paused"] = out.paused
        await asyncio.wait_for(resumed.wait(), 30)
        state["resumed"] = not out.paused
        out.watch(None, None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def slow_client(port: int) -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            while "paused" not in state:  # not reading until the server is paused
                time.sleep(0.01)
            total = 0
            out = b""
            while not out.endswith(b"0\r\n\r\n"):
                got = s.recv(1 << 20)
                if not got:
                    break
                total += len(got)
                out = out[-16:] + got
            return total

    async def main() -> int:
        async with served(app) as port:
            return await asyncio.to_thread(slow_client, port)

    total = asyncio.run(main())
    assert state["paused"] is True and state["resumed"] is True
    assert flows == [True, False]
    assert total > int(state["paused at"]), state  # every write reached the client


def test_a_finished_answer_needs_no_garbage_collector():
    """The ClientOut sits in its cycle's scope and refers back to the cycle weakly: once
    the connection's next request has begun, the last answer's cycle (its scope, headers
    and ClientOut) is freed at once, not left for the collector (which it would otherwise
    keep busy, one cycle of objects a request)."""
    cycles: list[weakref.ref] = []

    async def app(scope, receive, send):
        cycles.append(weakref.ref(send.__self__))  # the RequestResponseCycle
        assert scope["extensions"][CLIENT_OUT].paused is False
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok", "more_body": False})

    assert _first_cycle_freed(app, cycles), "the first answer's cycle outlived its request"


def test_a_hang_up_calls_the_watching_relay_back_once():
    calls: list[str] = []
    gone: list[bool] = []
    done = asyncio.Event()

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        await receive()  # the request's (empty) body
        path = scope["path"]
        out.watch(lambda: calls.append(path))
        if path == "/unwatched":
            out.watch(None)  # taken back: a hang-up now calls nothing
        await send({"type": "http.response.start", "status": 200, "headers": []})
        assert (await receive())["type"] == "http.disconnect"  # once the client has left
        gone.append(out.gone)
        out.write(b"dropped")  # the client is gone: nothing happens
        out.watch(lambda: calls.append("late " + path))  # gone already: called at once
        done.set()

    async def main() -> None:
        async with served(app) as port:
            for path in (b"/watched", b"/unwatched"):
                done.clear()
                await _leave_after_head(port, done, path)

    asyncio.run(main())
    assert calls == ["/watched", "late /watched", "late /unwatched"]
    assert gone == [True, True]


def test_a_reply_watching_through_it_is_cancelled_by_a_hang_up_without_a_task():
    seen: dict[str, object] = {}
    done = asyncio.Event()

    async def app(scope, receive, send):
        await receive()
        reply = Reply(send, out=scope["extensions"][CLIENT_OUT])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        before = asyncio.all_tasks()
        async with reply.watching():
            seen["tasks added"] = len(asyncio.all_tasks() - before)
            await asyncio.sleep(60)  # the engine's long prefill; the client leaves
            seen["slept through"] = True
        seen["disconnected"] = reply.disconnected
        done.set()

    async def main() -> None:
        async with served(app) as port:
            await _leave_after_head(port, done)

    asyncio.run(main())
    assert seen == {"tasks added": 0, "disconnected": True}


def test_a_watched_answer_needs_no_garbage_collector():
    """The reply's callbacks sit on the ClientOut while it watches (they refer to the
    reply, the reply to the cycle's send): a finished answer's cycle is freed at once,
    not left for the collector."""
    cycles: list[weakref.ref] = []

    async def app(scope, receive, send):
        cycles.append(weakref.ref(send.__self__))
        await receive()
        reply = Reply(send, out=scope["extensions"][CLIENT_OUT])
        async with reply.watching():
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await reply.end(b"ok")

    assert _first_cycle_freed(app, cycles), "the first answer's cycle outlived its request"


def _first_cycle_freed(app, cycles: list) -> bool:
    """Two requests on one connection to `app` (which keeps a weak reference to each
    request's cycle in `cycles`), the collector off: whether the first answer's cycle was
    freed once the second request had begun."""

    async def main() -> bool:
        async with served(app) as port:
            reader, w = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):
                w.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"0\r\n\r\n")
            # the first answer's task ends at its last send; wait for that, not a time
            for _ in range(500):
                if cycles[0]() is None:
                    break
                await asyncio.sleep(0.01)
            freed = cycles[0]() is None
            w.close()
            return freed

    gc.disable()
    try:
        return asyncio.run(main())
    finally:
        gc.enable()


def test_a_hang_up_is_told_once_to_the_answer_being_written():
    """Two requests in one write: the first is answered (its app watches), the second is
    read after it. When the client leaves, the first's `lost` is called once, its
    `receive` gets ``http.disconnect``, `gone` is set, and writes are dropped; watching
    a gone answer calls `lost` at once; a watch taken back is never called."""
    calls: list[str] = []
    seen: dict[str, object] = {}
    done = asyncio.Event()

    async def app(scope, receive, send):
        out = scope["extensions"][CLIENT_OUT]
        path = scope["path"]
        await receive()
        out.watch(lambda: calls.append(path), lambda paused: None)
        if path == "/unwatched":
            out.watch(None, None)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        out.write(b"before")
        seen[path] = (await receive())["type"], out.gone  # returns once the client left
        out.write(b"after")  # dropped, no error
        if path == "/a":
            out.watch(lambda: calls.append("late"))  # gone already: called at once
        done.set()

    async def main() -> None:
        async with served(app) as port:
            for first in (b"/a", b"/unwatched"):
                done.clear()
                reader, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(b"GET " + first + b" HTTP/1.1\r\nhost: x\r\n\r\n")
                w.write(b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n")
                await reader.readuntil(b"before\r\n")
                w.close()
                await asyncio.wait_for(done.wait(), 30)

    asyncio.run(main())
    assert seen == {p: ("http.disconnect", True) for p in ("/a", "/unwatched")}
    assert calls == ["/a", "late"]
