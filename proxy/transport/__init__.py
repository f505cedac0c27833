"""The upstream HTTP client(s), behind httpx's client API.

The relay and the engines' probes talk to an ``httpx.AsyncClient``; what moves the
bytes is its transport: :class:`~proxy.transport.lean.LeanTransport` (``lean``) or
httpx's own (``httpx``). :func:`make_client` builds one client per upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from .lean import LeanTransport

CLIENTS = ("lean", "httpx")


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How one upstream's client connects and waits."""

    kind: str = "lean"  # one of CLIENTS
    connect_timeout: float = 10.0
    read_timeout: float = 600.0


def make_client(
    base_url: str, options: ClientOptions, api_key: str | None = None
) -> httpx.AsyncClient:
    """A pooled keep-alive client for one upstream. The engine key, when there is one,
    also goes with the proxy's own calls (model lists, detection, gauge scrapes), so an
    engine that requires one is not taken for down."""
    transport = (
        LeanTransport(max_keepalive=256, keepalive_expiry=60.0) if options.kind == "lean" else None
    )
    return httpx.AsyncClient(
        base_url=base_url,
        timeout=httpx.Timeout(
            connect=options.connect_timeout,
            read=options.read_timeout,
            write=options.read_timeout,
            pool=None,
        ),
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=60.0
        ),
        follow_redirects=False,
        trust_env=False,
        headers={"authorization": f"Bearer {api_key}"} if api_key else None,
        transport=transport,
    )


__all__ = ["CLIENTS", "ClientOptions", "LeanTransport", "make_client"]
