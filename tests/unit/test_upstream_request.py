"""The upstream request built through httpx's ``stream=`` form
(proxy.core.upstream_call.upstream_request) is the request ``content=`` builds: the same
method, URL, extensions, body, and headers in the same order, Host and Content-Length
added (or not) as httpx adds them, whatever the client's headers and the method."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core.upstream_call import upstream_request

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
def test_the_stream_form_builds_the_content_form_request(method, url, headers, body):
    ext = {"timeout": {"connect": 1.0, "read": None, "write": 2.0, "pool": 3.0}}
    ours = upstream_request(method, httpx.URL(url), headers, body, ext)
    theirs = httpx.Request(method, httpx.URL(url), headers=headers, content=body, extensions=ext)
    assert ours.method == theirs.method
    assert ours.url == theirs.url
    assert ours.headers.raw == theirs.headers.raw
    assert ours.content == theirs.content == body
    assert ours.extensions == theirs.extensions
