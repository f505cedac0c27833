"""The upstream request phasewatch builds is the request httpx's ``content=`` form builds:
headers in the same order, Host and Content-Length added (or not) as httpx adds them,
whatever the client's headers and the method. Sent as its parts through the lean
transport (``LeanTransport.send``), it puts the same bytes on the wire as httpx's request
through ``handle_async_request``."""

from __future__ import annotations

import asyncio
import socket

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.upstream_call import upstream_fields
from proxy.transport.lean import LeanTransport

from ..support.fake_engine import FakeEngine, Reply, response

_NAMES = st.sampled_from(
    [
        b"host",
        b"Host",
        b"content-length",
        b"Content-Length",
        b"transfer-encoding",
        b"Transfer-Encoding",
        b"content-type",
        b"authorization",
        b"x-request-id",
        b"accept-encoding",
        b"traceparent",
    ]
)
_HEADERS = st.lists(
    st.tuples(_NAMES, st.binary(min_size=0, max_size=12).filter(lambda v: b"\r" not in v)),
    max_size=6,
)
_METHODS = st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
_URLS = st.sampled_from(
    [
        "http://127.0.0.1:8000/v1/chat/completions",
        "http://engine/v1/completions?x=1",
        "https://gpu-box.example:443/api/chat",
        "http://[::1]:11434/api/generate",
    ]
)


@settings(max_examples=500, deadline=None)
@given(_METHODS, _URLS, _HEADERS, st.binary(max_size=64))
def test_the_fields_are_the_headers_of_httpxs_content_form_request(method, url, headers, body):
    fields = upstream_fields(method, httpx.URL(url), headers, len(body))
    theirs = httpx.Request(method, httpx.URL(url), headers=headers, content=body)
    assert fields == theirs.headers.raw


async def _sent_bytes(*senders) -> list[bytes]:
    """What one request from each of `senders` (``send(transport, base_url)``, each over
    a transport of its own) put on the wire, to one fake engine."""
    with FakeEngine(lambda req: Reply(response(200, b"ok"))) as engine:
        for send in senders:
            transport = LeanTransport()
            try:
                resp = await send(transport, engine.url)
                assert await resp.aread() == b"ok"  # the whole request came: answered
                await resp.aclose()
            finally:
                await transport.aclose()
        return [r.raw for r in engine.requests]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["POST", "post", "Put", "GET", "DELETE"]),
    st.sampled_from(["/v1/chat/completions", "/api/chat?stream=1", "/a%20b"]),
    # the relay never passes the client's framing on (proxy.core.headers): nor does this
    _HEADERS.map(
        lambda hs: [
            (k, v) for k, v in hs if k.lower() not in (b"transfer-encoding", b"content-length")
        ]
    ),
    st.binary(max_size=64),
)
def test_the_parts_put_the_httpx_request_on_the_wire(method, target, headers, body):
    """``LeanTransport.send`` with the parts the relay builds writes exactly what
    ``handle_async_request`` writes for httpx's own request of the same method, URL,
    headers and body."""
    timeouts = {"connect": 5.0, "read": 5.0, "write": 5.0, "pool": 5.0}

    async def by_parts(transport, base):
        url = httpx.URL(base + target)
        fields = upstream_fields(method.upper(), url, headers, len(body))
        return await transport.send(method.upper(), url, fields, body, timeouts)

    async def by_httpx(transport, base):
        req = httpx.Request(
            method, base + target, headers=headers, content=body, extensions={"timeout": timeouts}
        )
        return await transport.handle_async_request(req)

    ours, theirs = asyncio.run(_sent_bytes(by_parts, by_httpx))
    assert ours == theirs


def test_an_error_of_a_request_sent_as_its_parts_names_that_request():
    """httpx's errors carry their request; one sent without an ``httpx.Request`` gets one
    made for the error, with its method and URL."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = httpx.URL(f"http://127.0.0.1:{port}/v1/chat/completions")

    async def send():
        transport = LeanTransport()
        try:
            await transport.send("POST", url, [(b"Host", url.netloc)], b"{}", {"connect": 5.0})
        finally:
            await transport.aclose()

    try:
        asyncio.run(send())
    except httpx.ConnectError as exc:
        assert exc.request.method == "POST" and exc.request.url == url
    else:
        raise AssertionError("a closed port accepted a connection")
