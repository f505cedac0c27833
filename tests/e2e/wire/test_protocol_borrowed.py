"""What phasewatch's protocol borrows from uvicorn (proxy.runtime.borrowed) is still there,
on the installed uvicorn, used for real: a server on loopback makes the protocol from
``Config.http``, the protocol keeps the server's state (connections, tasks, requests,
default headers), and uvicorn's shutdown closes an idle connection at once and a busy one
after its answer. A uvicorn release that renames any of it must fail here, by name."""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from uvicorn.server import ServerState

from proxy.runtime.borrowed import BORROWED
from proxy.runtime.http1 import Http1Protocol, guarded_protocol

from ...support.servers import free_port


def test_the_borrowed_names_exist():
    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    missing = [n for n in BORROWED["Config"] if not hasattr(config, n)]
    assert not missing, f"uvicorn's Config lost {missing}"
    state = ServerState()
    missing = [n for n in BORROWED["ServerState"] if not hasattr(state, n)]
    assert not missing, f"uvicorn's ServerState lost {missing}"
    assert isinstance(state.connections, set) and isinstance(state.tasks, set)
    assert isinstance(state.total_requests, int) and isinstance(state.default_headers, list)
    assert all(callable(getattr(Http1Protocol, n, None)) for n in BORROWED["protocol"])
    server = uvicorn.Server(config)
    missing = [
        n
        for n in BORROWED["Server"]
        if not hasattr(config if n == "get_loop_factory" else server, n)
    ]
    assert not missing, f"uvicorn's Server lost {missing}"


def _get(port: int, path: bytes = b"/", close: bool = False) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    extra = b"connection: close\r\n" if close else b""
    s.sendall(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while True:
        got = s.recv(65536)
        if not got:
            return out
        out += got


def test_uvicorn_runs_the_protocol_with_its_server_state(caplog):
    """The protocol made by uvicorn's server: its connections and tasks are in the
    server's state while they last, each answer counts and starts with the default
    headers, --root-path prefixes the path; at shutdown an idle connection is closed at
    once and a busy one after its answer; an application's failure is told on uvicorn's
    logger."""
    release = asyncio.Event()
    seen: dict[str, object] = {}

    async def app(scope, receive, send):
        if scope["path"].endswith("/fail"):
            raise ValueError("the application failed")
        if scope["path"].endswith("/slow"):
            seen["tasks"] = len(server.server_state.tasks)
            seen["connections"] = len(server.server_state.connections)
            await release.wait()
        seen["path"] = scope["path"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(64 * 1024, 10.0, lambda reason: None),
        lifespan="off",
        log_config=None,
        root_path="/base",
        server_header=True,
        date_header=False,
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)

    async def main() -> tuple[bytes, bytes, bytes, bytes]:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        state = server.server_state
        plain = await asyncio.to_thread(lambda: _read_all(_get(port, b"/x", close=True)))
        failed = await asyncio.to_thread(lambda: _read_all(_get(port, b"/fail")))
        idle = await asyncio.to_thread(_get, port)  # answered, then idle
        busy = await asyncio.to_thread(_get, port, b"/slow")
        while "tasks" not in seen:
            await asyncio.sleep(0.01)
        assert all(isinstance(c, Http1Protocol) for c in state.connections)
        server.should_exit = True
        idle_out = await asyncio.to_thread(_read_all, idle)  # closed by the shutdown
        release.set()
        busy_out = await asyncio.to_thread(_read_all, busy)
        await task
        assert not state.connections and not state.tasks
        assert state.total_requests == 4
        return plain, failed, idle_out, busy_out

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        plain, failed, idle_out, busy_out = asyncio.run(main())
    assert plain.startswith(b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\n"), plain
    assert seen["path"] == "/base/slow"
    assert seen["tasks"] == 1 and seen["connections"] == 2
    assert failed.startswith(b"HTTP/1.1 500 Internal Server Error\r\n"), failed
    assert any("Exception in ASGI application" in r.getMessage() for r in caplog.records)
    assert idle_out.endswith(b"0\r\n\r\n") and idle_out.count(b"HTTP/1.1") == 1
    assert busy_out.startswith(b"HTTP/1.1 200 OK\r\n") and busy_out.endswith(
        b"2\r\nok\r\n0\r\n\r\n"
    )
