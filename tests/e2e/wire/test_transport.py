"""The upstream transport (proxy.transport.lean) on its own, against raw-socket
fake engines on loopback: whole responses or an error, one send per non-idempotent
request, idle expiry, no added headers, no decompression, connections with unexpected
bytes discarded, status edges, limits and TLS (a private CA made by trustme)."""

from __future__ import annotations

import asyncio
import gzip
import ssl

import httpx
import pytest
import trustme

from proxy.transport import ClientOptions, TLSOptions, make_client, make_transport

from ...support.fake_engine import FakeEngine, Reply, Request, response
from ...support.hostile import closed_port, full_backlog


def transport(**options) -> httpx.AsyncBaseTransport:
    return make_transport(ClientOptions(**options))


async def fetch(
    t: httpx.AsyncBaseTransport,
    method: str,
    url: str,
    body: bytes = b"",
    headers: list[tuple[str, str]] | None = None,
    **options,
) -> tuple[httpx.Response, bytes]:
    """One request straight through the transport, as the relay sends it."""
    req = httpx.Request(
        method,
        url,
        headers=headers,
        content=body,
        extensions={"timeout": ClientOptions(**options).timeouts()},
    )
    resp = await t.handle_async_request(req)
    try:
        data = b"".join([chunk async for chunk in resp.aiter_raw()])
    finally:
        await resp.aclose()
    return resp, data


BODY = bytes(range(256)) * 40  # 10,240 bytes, every byte value


# --- whole responses ---------------------------------------------------------------------


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
async def test_bodies_arrive_whole_and_exact(framing):
    wire = response(
        200,
        BODY,
        [("Content-Type", "application/octet-stream")],
        chunked=framing == "chunked",
        close_delimited=framing == "close",
    )
    then = "close" if framing == "close" else "keep"
    with FakeEngine(lambda req: Reply(wire, then)) as engine:
        t = transport()
        try:
            for _ in range(2):
                resp, data = await fetch(t, "GET", engine.url + "/file")
                assert resp.status_code == 200
                assert data == BODY
            # keep-alive where the framing allows it; a new connection after a close
            assert engine.connections == (2 if framing == "close" else 1)
        finally:
            await t.aclose()


@pytest.mark.parametrize(
    "framing,then",
    [("length", "close"), ("length", "reset"), ("chunked", "close"), ("chunked", "reset")]
    + [("close", "reset")],
)
async def test_a_body_cut_short_is_an_error(framing, then):
    """A reset or EOF before the body's end never passes for a whole body (a close-
    delimited body ends with a clean close only)."""
    if framing == "length":
        wire = response(200, BODY[:3000], length=len(BODY))
    elif framing == "chunked":
        wire = response(200, BODY, chunked=True)[:3000]
    else:
        wire = response(200, BODY[:3000], close_delimited=True)
    with FakeEngine(lambda req: Reply(wire, then)) as engine:
        t = transport()
        try:
            req = httpx.Request("GET", engine.url + "/file")
            resp = await t.handle_async_request(req)
            got = b""
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                async for chunk in resp.aiter_raw():
                    got += chunk
            await resp.aclose()
            assert len(got) < len(BODY)
        finally:
            await t.aclose()


# --- one send per request -----------------------------------------------------------------


@pytest.mark.parametrize("method", ["POST", "GET"])
async def test_a_request_is_resent_only_when_idempotent(method):
    """The engine takes the second request on a kept-alive connection and closes without a
    byte: a POST fails (the engine may have started a generation), a GET is retried."""

    def answer(req: Request) -> Reply:
        if req.target == "/first":
            return Reply(response(200, b"ok"))
        if len([r for r in engine.requests if r.target == "/second"]) == 1:  # the first one
            return Reply(then="drop")
        return Reply(response(200, b"again"))

    with FakeEngine(answer) as engine:
        t = transport()
        try:
            await fetch(t, "GET", engine.url + "/first")
            if method == "POST":
                with pytest.raises(httpx.RemoteProtocolError):
                    await fetch(t, "POST", engine.url + "/second", b'{"prompt":"hi"}')
                assert len([r for r in engine.requests if r.target == "/second"]) == 1
            else:
                resp, data = await fetch(t, "GET", engine.url + "/second")
                assert data == b"again"
                assert len([r for r in engine.requests if r.target == "/second"]) == 2
        finally:
            await t.aclose()


async def test_idle_connections_expire_before_the_engines_keepalive():
    with FakeEngine(lambda req: Reply(response(200, b"ok"))) as engine:
        t = transport(upstream_keepalive=0.3)
        try:
            await fetch(t, "POST", engine.url + "/a", b"{}")
            await fetch(t, "POST", engine.url + "/a", b"{}")
            assert engine.connections == 1  # reused within the expiry
            await asyncio.sleep(0.6)  # idle past the expiry (the behaviour under test)
            await fetch(t, "POST", engine.url + "/a", b"{}")
            assert engine.connections == 2
        finally:
            await t.aclose()


# --- transparency ---------------------------------------------------------------------------


async def test_exactly_the_clients_headers_go_upstream():
    with FakeEngine(lambda req: Reply(response(200, b"ok"))) as engine:
        t = transport()
        try:
            sent = [("Content-Type", "application/json"), ("X-Custom", "a b"), ("x-dup", "1")]
            sent.append(("x-dup", "2"))
            await fetch(t, "POST", engine.url + "/v1/chat/completions", b"{}", sent)
            await fetch(t, "GET", engine.url + "/v1/models")
            post, get = engine.requests
            # the client's, in its order, with the framing and Host the proxy must set
            names = post.header_names()
            assert [n for n in names if n not in ("host", "content-length")] == [
                "content-type",
                "x-custom",
                "x-dup",
                "x-dup",
            ]
            assert sorted(names) == sorted(
                ["host", "content-type", "x-custom", "x-dup", "x-dup", "content-length"]
            )
            assert [v for k, v in post.headers if k.lower() == "x-dup"] == ["1", "2"]
            assert set(get.header_names()) == {"host"}
            # the probes' client adds nothing either
            client = make_client(engine.url, ClientOptions(), transport=t)
            await client.get("/v1/models")
            assert set(engine.requests[-1].header_names()) == {"host"}
        finally:
            await t.aclose()


async def test_the_target_goes_upstream_as_sent():
    with FakeEngine(lambda req: Reply(response(200, b"ok"))) as engine:
        t = transport()
        try:
            target = "/a/%2e%2e/b%20c//d?x=%2F&y=1+2&z"
            await fetch(t, "GET", engine.url + target)
            assert engine.requests[0].target == target
        finally:
            await t.aclose()


async def test_no_decompression():
    packed = gzip.compress(b'{"answer": 42}' * 100)
    wire = response(200, packed, [("Content-Encoding", "gzip")])
    with FakeEngine(lambda req: Reply(wire)) as engine:
        t = transport()
        try:
            resp, data = await fetch(
                t, "GET", engine.url + "/x", headers=[("Accept-Encoding", "gzip")]
            )
            assert data == packed
            assert resp.headers["content-encoding"] == "gzip"
        finally:
            await t.aclose()


# --- connections that carried something unexpected ------------------------------------------


@pytest.mark.parametrize("when", ["with", "after"])
async def test_an_unsolicited_response_is_never_delivered(when):
    """An engine writes a second response after a complete one (in the same write, or later
    on the idle connection): the connection is closed, the next request gets its own."""
    extra = response(200, b"STALE")

    def answer(req: Request) -> Reply:
        if req.target == "/one":
            if when == "with":
                return Reply(response(200, b"one") + extra)
            return Reply(response(200, b"one"), later=extra, pause=0.05)
        return Reply(response(200, b"two"))

    with FakeEngine(answer) as engine:
        t = transport()
        try:
            resp, data = await fetch(t, "GET", engine.url + "/one")
            assert data == b"one"
            if when == "after":
                await _until(lambda: engine.connections >= 1 and _sent_later(engine))
            for _ in range(2):
                resp, data = await fetch(t, "POST", engine.url + "/two", b"{}")
                assert data == b"two"
            assert engine.connections == 2
        finally:
            await t.aclose()


def _sent_later(engine: FakeEngine) -> bool:
    return len(engine.requests) >= 1


async def _until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the later bytes are written 50 ms after the answer


# --- status edges -----------------------------------------------------------------------------


async def test_1xx_heads_are_skipped():
    wire = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" + response(200, b"ok")
    )
    with FakeEngine(lambda req: Reply(wire)) as engine:
        t = transport()
        try:
            resp, data = await fetch(t, "POST", engine.url + "/x", b"{}")
            assert (resp.status_code, data) == (200, b"ok")
            assert "link" not in resp.headers
        finally:
            await t.aclose()


@pytest.mark.parametrize("status", [204, 304])
async def test_bodiless_statuses(status):
    with FakeEngine(lambda req: Reply(response(status, headers=[("ETag", '"v1"')]))) as engine:
        t = transport()
        try:
            for _ in range(2):
                resp, data = await fetch(t, "GET", engine.url + "/x")
                assert (resp.status_code, data) == (status, b"")
        finally:
            await t.aclose()


async def test_head_has_no_body():
    def answer(req: Request) -> Reply:
        if req.method == "HEAD":  # the length a GET would have, and no body
            return Reply(b"HTTP/1.1 200 OK\r\nContent-Length: 10240\r\n\r\n")
        return Reply(response(200, b"after"))

    with FakeEngine(answer) as engine:
        t = transport()
        try:
            resp, data = await fetch(t, "HEAD", engine.url + "/x")
            assert (resp.status_code, data, resp.headers["content-length"]) == (200, b"", "10240")
            resp, data = await fetch(t, "GET", engine.url + "/x")
            assert data == b"after"
        finally:
            await t.aclose()


async def test_trailers_are_dropped():
    wire = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n"
        b"5\r\nhello\r\n0\r\nX-Checksum: abc\r\n\r\n"
    )
    with FakeEngine(lambda req: Reply(wire)) as engine:
        t = transport()
        try:
            for _ in range(2):
                resp, data = await fetch(t, "GET", engine.url + "/x")
                assert data == b"hello"
                assert "x-checksum" not in resp.headers
        finally:
            await t.aclose()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\n\r\n\x81\x05hello",
        # without Connection: upgrade the parser stops with an error after the head: the
        # answer is still a bodiless 101 at once, not a wait nothing would end
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
    ],
    ids=["upgrade", "no-connection-upgrade"],
)
async def test_101_is_a_bodiless_answer_and_the_connection_is_not_reused(head):

    def answer(req: Request) -> Reply:
        if req.target == "/ws":
            return Reply(head, then="hang")
        return Reply(response(200, b"plain"))

    with FakeEngine(answer) as engine:
        t = transport()
        try:
            resp, data = await asyncio.wait_for(fetch(t, "GET", engine.url + "/ws"), 10)
            assert (resp.status_code, data) == (101, b"")
            resp, data = await fetch(t, "GET", engine.url + "/x")
            assert data == b"plain"
            assert engine.connections == 2
        finally:
            await t.aclose()


# --- limits -------------------------------------------------------------------------------------


async def test_a_response_head_over_the_limit_is_refused():
    big = response(200, b"ok", [("X-Big", "a" * 7000)] * 12)  # 84 KB of headers

    def answer(req: Request) -> Reply:
        if req.target == "/forever":  # a head that never ends
            return Reply(forever=b"HTTP/1.1 200 OK\r\n")
        return Reply(big if req.target == "/big" else response(200, b"small"))

    with FakeEngine(answer) as engine:
        t = transport(upstream_max_head_bytes=64 * 1024)
        try:
            with pytest.raises(httpx.RemoteProtocolError, match="head"):
                await fetch(t, "GET", engine.url + "/big")
            with pytest.raises(httpx.RemoteProtocolError):
                await asyncio.wait_for(fetch(t, "GET", engine.url + "/forever"), 20)
            resp, data = await fetch(t, "GET", engine.url + "/small")
            assert data == b"small"
        finally:
            await t.aclose()


async def test_connections_per_upstream_are_capped_with_a_bounded_wait():
    stream = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n"

    def answer(req: Request) -> Reply:
        if req.target == "/long":
            return Reply(stream, then="hang")
        return Reply(response(200, b"short"))

    with FakeEngine(answer) as engine:
        t = transport(upstream_max_connections=1)
        try:
            req = httpx.Request(
                "GET",
                engine.url + "/long",
                extensions={"timeout": ClientOptions().timeouts()},
            )
            long = await t.handle_async_request(req)
            with pytest.raises(httpx.PoolTimeout):
                await fetch(t, "GET", engine.url + "/short", upstream_pool_timeout=0.3)
            waiting = asyncio.create_task(fetch(t, "GET", engine.url + "/short"))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            await long.aclose()  # frees the one connection: the waiter goes on
            resp, data = await asyncio.wait_for(waiting, 10)
            assert data == b"short"
            assert engine.connections == 2  # the cut stream's connection was not reused
        finally:
            await t.aclose()


async def test_read_timeout():
    with FakeEngine(lambda req: Reply(then="hang")) as engine:
        t = transport()
        try:
            with pytest.raises(httpx.ReadTimeout):
                await fetch(t, "POST", engine.url + "/x", b"{}", read_timeout=0.3)
        finally:
            await t.aclose()


async def test_read_timeout_mid_body():
    wire = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf"
    with FakeEngine(lambda req: Reply(wire, then="hang")) as engine:
        t = transport()
        try:
            with pytest.raises(httpx.ReadTimeout):
                await fetch(t, "POST", engine.url + "/x", b"{}", read_timeout=0.3)
        finally:
            await t.aclose()


async def test_read_timeout_on_a_reused_connection_keeps_its_own_deadline():
    """A kept-alive connection's second request times out at its own (shorter) read
    deadline, not at the first request's (the lean transport keeps one read timer a
    connection across requests)."""

    def answer(req: Request) -> Reply:
        if req.target == "/ok":
            return Reply(response(200, b"ok"))
        return Reply(then="hang")

    with FakeEngine(answer) as engine:
        t = transport()
        try:
            resp, data = await fetch(t, "POST", engine.url + "/ok", b"{}", read_timeout=60)
            assert data == b"ok"
            with pytest.raises(httpx.ReadTimeout):
                await asyncio.wait_for(
                    fetch(t, "POST", engine.url + "/x", b"{}", read_timeout=0.3), 20
                )
            assert engine.connections == 1  # the second request went on the first's
        finally:
            await t.aclose()


async def test_write_timeout():
    """An engine that accepts and never reads: a large body blocks, then times out."""
    with FakeEngine(stall=True) as engine:
        t = transport()
        try:
            with pytest.raises(httpx.WriteTimeout):
                await asyncio.wait_for(
                    fetch(t, "POST", engine.url + "/x", b"x" * (32 << 20), write_timeout=0.5),
                    10,
                )
        finally:
            await t.aclose()


async def test_connect_timeout():
    """A listener whose accept queue is full drops new SYNs: the connect never completes."""
    with full_backlog() as port:
        t = transport()
        try:
            with pytest.raises(httpx.ConnectTimeout):
                await fetch(t, "GET", f"http://127.0.0.1:{port}/x", connect_timeout=0.5)
        finally:
            await t.aclose()


async def test_connect_refused():
    port = closed_port()
    t = transport()
    try:
        with pytest.raises(httpx.ConnectError):
            await fetch(t, "GET", f"http://127.0.0.1:{port}/x")
    finally:
        await t.aclose()


# --- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_files(ca, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("phasewatch-client")
    files = {
        "ca": d / "ca.pem",
        "server": d / "server.pem",
        "client_cert": d / "client-cert.pem",
        "client_key": d / "client-key.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.private_key_and_cert_chain_pem.write_to_path(str(files["server"]))
    client.cert_chain_pems[0].write_to_path(str(files["client_cert"]))
    client.private_key_pem.write_to_path(str(files["client_key"]))
    return {k: str(v) for k, v in files.items()}


def server_context(tls_files, require_client: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls_files["server"])
    if require_client:
        ctx.load_verify_locations(tls_files["ca"])
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


async def test_https_engine_with_a_private_ca(tls_files):
    ok = Reply(response(200, BODY))
    with FakeEngine(lambda req: ok, ssl_context=server_context(tls_files)) as engine:
        trusted = transport(tls=TLSOptions(ca=tls_files["ca"]))
        untrusted = transport()
        insecure = transport(tls=TLSOptions(insecure=True))
        try:
            resp, data = await fetch(trusted, "GET", engine.url + "/x")
            assert data == BODY
            with pytest.raises(httpx.ConnectError):
                await fetch(untrusted, "GET", engine.url + "/x")
            resp, data = await fetch(insecure, "GET", engine.url + "/x")
            assert data == BODY
        finally:
            for t in (trusted, untrusted, insecure):
                await t.aclose()


async def test_mutual_tls(tls_files):
    ok = Reply(response(200, b"mtls"))
    ctx = server_context(tls_files, require_client=True)
    with FakeEngine(lambda req: ok, ssl_context=ctx) as engine:
        with_cert = transport(
            tls=TLSOptions(
                ca=tls_files["ca"], cert=tls_files["client_cert"], key=tls_files["client_key"]
            ),
        )
        without = transport(tls=TLSOptions(ca=tls_files["ca"]))
        try:
            resp, data = await fetch(with_cert, "GET", engine.url + "/x")
            assert data == b"mtls"
            with pytest.raises(httpx.HTTPError):
                await fetch(without, "GET", engine.url + "/x")
        finally:
            await with_cert.aclose()
            await without.aclose()


def test_bad_tls_files_are_refused_at_start(tmp_path):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match="TLS"):
        make_transport(ClientOptions(tls=TLSOptions(ca=missing)))
