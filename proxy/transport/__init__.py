"""The upstream HTTP client, behind httpx's transport API.

The relay sends through a :class:`~.lean.LeanTransport` (one per upstream, its own pool),
the request as its parts (``LeanTransport.send``); the engines' probes use an
``httpx.AsyncClient`` over the same transport (httpx's transport API). What moves the
bytes is :mod:`.lean` (asyncio + httptools): whole responses or an error, one send per
non-idempotent request, TLS options, limits, no added headers, no decompression. Why not a
library client: docs/transport.md. Tests give an upstream a real engine on loopback.
"""

from __future__ import annotations

import logging
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx

from .lean import LeanTransport
from .options import IDEMPOTENT, ClientOptions, TLSOptions

log = logging.getLogger(__name__)

#: httpx's client adds these to every request unless removed; a transparent proxy (and
#: its probes, which an engine should see as plainly) sends none of them.
_CLIENT_DEFAULTS = ("accept", "accept-encoding", "connection", "user-agent")


def make_transport(options: ClientOptions, name: str = "") -> LeanTransport:
    """The transport for one upstream (its own pool). A bad TLS file raises ValueError."""
    tls = options.tls
    context = tls.context() if (tls.ca or tls.cert or tls.insecure) else None
    if tls.insecure:
        log.warning(
            "TLS certificate verification is off for this upstream (--upstream-insecure)",
            extra={"fields": {"upstream": name}},
        )
    return LeanTransport(options, context, name)


def make_client(
    base_url: str,
    options: ClientOptions,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> httpx.AsyncClient:
    """A client for the proxy's own calls to one upstream (model lists, detection, gauge
    scrapes) over `transport` (default: a new one). The engine key, when there is one,
    goes with them, so an engine that requires one is not taken for down. No cookies are
    kept: an engine's Set-Cookie is its client's business."""
    client = httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(**options.timeouts()),
        follow_redirects=False,
        trust_env=False,
        cookies=CookieJar(DefaultCookiePolicy(allowed_domains=[])),
        headers={"authorization": f"Bearer {api_key}"} if api_key else None,
        transport=transport or make_transport(options),
    )
    for name in _CLIENT_DEFAULTS:
        client.headers.pop(name, None)
    return client


__all__ = [
    "IDEMPOTENT",
    "ClientOptions",
    "LeanTransport",
    "TLSOptions",
    "make_client",
    "make_transport",
]
