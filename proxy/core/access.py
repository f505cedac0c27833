"""Who may use the proxy, and which credentials reach the engine.

With proxy keys configured, a client must present one (``Authorization: Bearer KEY`` or
``x-api-key: KEY``). The engine then gets the key configured for its upstream, if any;
a phasewatch key is never passed on to an engine. With no proxy keys, the client's own
``Authorization`` reaches the engine unless an upstream key replaces it. Keys are
compared in constant time and never logged or exported.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Iterable


class Access:
    def __init__(self, api_keys: list[str], upstream_keys: dict[str, str]) -> None:
        self._keys = [k.encode() for k in api_keys if k]
        self._upstream = {name: ("Bearer " + key).encode() for name, key in upstream_keys.items()}

    @property
    def required(self) -> bool:
        """Whether clients must present a key at all."""
        return bool(self._keys)

    def allowed(self, headers: Iterable[tuple[bytes, bytes]], basic: bool = False) -> bool:
        """Whether the request carries a valid proxy key (always, when none are set).
        `basic`: also take HTTP Basic's password (the own API's pages, for browsers)."""
        if not self._keys:
            return True
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                if self._match(v[7:].strip()):
                    return True
            elif k == b"authorization" and basic and v[:6].lower() == b"basic ":
                try:
                    _, _, password = base64.b64decode(v[6:].strip(), validate=True).partition(b":")
                except (binascii.Error, ValueError):
                    continue
                if self._match(password):
                    return True
            elif k == b"x-api-key" and self._match(v.strip()):
                return True
        return False

    def _match(self, presented: bytes) -> bool:
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]], upstream: str
    ) -> list[tuple[bytes, bytes]]:
        """The request headers as the engine should see them."""
        key = self._upstream.get(upstream)
        if key is None and not self._keys:
            return headers
        out = []
        for k, v in headers:
            if k == b"x-api-key" and self._keys and self._match(v.strip()):
                continue  # the phasewatch key: not the engine's business
            if k == b"authorization" and (
                key is not None or (v[:7].lower() == b"bearer " and self._match(v[7:].strip()))
            ):
                continue
            out.append((k, v))
        if key is not None:
            out.append((b"authorization", key))
        return out
