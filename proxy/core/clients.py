"""Who a request is for: the bounded `client` label of requests, tokens and energy.

A named proxy key (``--api-key team-a=KEY``) names its holder; otherwise a request header
(``--client-header x-team``) may, but only with one of the names ``--clients`` lists:
any other value is ``other`` and no value at all ``unknown``, so a client can never grow
the series (the same rule as the `model` label).
"""

from __future__ import annotations

from collections.abc import Iterable

#: A header value not in --clients.
OTHER = "other"
#: Nothing names the client (a bare key, no header).
UNKNOWN = "unknown"


class Clients:
    """Resolves the client label of a request."""

    def __init__(self, header: str | None = None, names: Iterable[str] = ()) -> None:
        self.header = header.lower().encode("latin-1") if header else None
        self.names = frozenset(names)

    def label(self, headers: Iterable[tuple[bytes, bytes]], key_client: str = "") -> str:
        """The client label: the named key's client, else the header's value when listed."""
        if key_client:
            return key_client
        if self.header is None:
            return UNKNOWN
        for k, v in headers:
            if k == self.header:
                value = v.decode("latin-1").strip()
                return value if value in self.names else OTHER
        return UNKNOWN
