"""The HTTP/1.1 protocol phasewatch serves with (proxy.runtime.http1, proxy.runtime.cycle)
keeps the semantics clients rely on, on raw sockets over loopback: an answer with no
length is chunked, a HEAD answer has no body, HTTP/1.0 and ``connection: close`` close
after the answer, pipelined requests are answered in order, ``Expect: 100-continue`` is
answered when the body is asked for, an application that fails before its head gets a
500 and one that returns mid-answer gets its connection closed, and a header value's
trailing whitespace is not part of it."""

from __future__ import annotations

import asyncio
import re
import socket

from ..relay.test_client_out import served
from .test_protocol_borrowed import _read_all


async def app(scope, receive, send):
    path = scope["path"]
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if path == "/fail":
        raise ValueError("the application failed before its head")
    headers = [(b"content-length", b"2")] if path == "/length" else []
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path == "/cut":
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        return  # returns without completing its answer
    if path == "/length":
        await send({"type": "http.response.body", "body": b"ok"})
        return
    seen = dict(scope["headers"]).get(b"x-seen", b"")
    out = b"%s %s [%s] %d" % (scope["method"].encode(), path.encode(), seen, len(body))
    await send({"type": "http.response.body", "body": out})


def _talk(port: int, data: bytes) -> bytes:
    """`data` sent on a new connection; everything read until the server closes it (or
    10 s of silence)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        try:
            return _read_all(s)
        except TimeoutError:
            return b"(still open)"


def _exchange(requests: dict[str, bytes]) -> dict[str, bytes]:
    """Each of `requests` on a connection of its own; what came back, less the server's
    default headers (its date and name: they lead every answer)."""

    async def main() -> dict[str, bytes]:
        async with served(app) as port:
            return {k: await asyncio.to_thread(_talk, port, v) for k, v in requests.items()}

    return {
        k: re.sub(rb"date: [^\r]*\r\nserver: uvicorn\r\n", b"", v)
        for k, v in asyncio.run(main()).items()
    }


def test_answers_are_framed_and_connections_end_as_clients_expect():
    got = _exchange(
        {
            "pipelined": b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
            b"HEAD /c HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            "http10": b"GET /old HTTP/1.0\r\n\r\n",
            "length": b"GET /length HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            "continue": b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"connection: close\r\ncontent-length: 2\r\n\r\nhi",
            "fail": b"GET /fail HTTP/1.1\r\nhost: x\r\n\r\n",
            "cut": b"GET /cut HTTP/1.1\r\nhost: x\r\n\r\n",
            "whitespace": b"GET /w HTTP/1.1\r\nhost: x\r\nx-seen: v \t\r\nconnection: close\r\n\r\n",
        }
    )
    a, b, c = got["pipelined"].split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert a == b"transfer-encoding: chunked\r\n\r\nb\r\nGET /a [] 0\r\n0\r\n\r\n", a
    assert b == b"transfer-encoding: chunked\r\n\r\nc\r\nPOST /b [] 3\r\n0\r\n\r\n", b
    assert c == b"connection: close\r\n\r\n", c  # HEAD: no body, no chunked framing
    assert got["http10"] == (
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
        b"d\r\nGET /old [] 0\r\n0\r\n\r\n"
    )
    assert got["length"] == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    # the body came with the head: no interim 100 (a server may omit it once the body is
    # there); one that waits for it gets it (test_hostile_fourth_wire.py)
    cont = got["continue"]
    assert cont.startswith(b"HTTP/1.1 200 OK") and cont.endswith(b"POST /e [] 2\r\n0\r\n\r\n"), cont
    assert got["fail"].startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
    assert got["fail"].endswith(b"connection: close\r\n\r\nInternal Server Error")
    assert got["cut"].endswith(b"4\r\npart\r\n"), got["cut"]  # closed, never completed
    assert got["whitespace"].endswith(b"GET /w [v] 0\r\n0\r\n\r\n"), got["whitespace"]
