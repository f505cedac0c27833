"""How one upstream's client connects, waits and trusts: the options every client takes."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

#: Methods a client may send twice (RFC 9110 §9.2.2): only these are ever re-sent, and
#: only when a reused idle connection turned out closed before any response byte.
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


@dataclass(frozen=True, slots=True)
class TLSOptions:
    """Whom an https upstream must prove to be, and who the proxy is to it."""

    ca: str | None = None  # PEM file of the CA(s) to trust instead of the system's
    cert: str | None = None  # PEM client certificate (mTLS) ...
    key: str | None = None  # ... and its key (default: inside the certificate file)
    insecure: bool = False  # no verification at all (warned at start)

    def context(self) -> ssl.SSLContext:
        """The TLS context; a missing or unreadable file raises ValueError."""
        try:
            ctx = ssl.create_default_context(cafile=self.ca)
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"upstream TLS files: {exc}") from None
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How one upstream's client connects and waits; every limit has a default."""

    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    #: Longest one write of the request may block (an engine that stopped reading).
    write_timeout: float = 60.0
    #: Most connections open to one upstream (busy and idle); 0: no limit.
    upstream_max_connections: int = 1024
    #: Longest a request waits for a free connection when upstream_max_connections are busy.
    upstream_pool_timeout: float = 30.0
    #: Idle keep-alive connections are dropped after this many seconds: below the
    #: engine's own idle timeout (uvicorn-based engines such as vLLM close at 5 s), so the
    #: proxy never sends a request on a connection the engine is closing.
    upstream_keepalive: float = 4.0
    #: Largest response head (status line and headers) taken from an engine.
    upstream_max_head_bytes: int = 64 * 1024
    tls: TLSOptions = field(default_factory=TLSOptions)

    def timeouts(self) -> dict[str, float | None]:
        """The per-request ``timeout`` extension every httpx transport reads."""
        return {
            "connect": self.connect_timeout,
            "read": self.read_timeout,
            "write": self.write_timeout,
            "pool": self.upstream_pool_timeout,
        }
