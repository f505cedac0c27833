"""Who may use the proxy, and which credentials reach the engine.

With proxy keys configured, a client must present one (``Authorization: Bearer KEY`` or
``x-api-key: KEY``). The engine then gets the key configured for its upstream, if any;
a phasewatch key is never passed on to an engine. With no proxy keys, the client's own
``Authorization`` reaches the engine unless an upstream key replaces it. Keys are
compared in constant time and never logged or exported. A key may be named after the
client holding it (``--api-key team-a=KEY``): its requests are labelled ``client=team-a``.

Browsers reach the own pages with HTTP Basic (any user name, the key as password) or with
a cookie set from a ``?key=`` link or the login form: the cookie holds a token derived
from the key (never the key), taken on the own pages only, never by the relay.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

#: The own pages' cookie (HttpOnly, SameSite=Strict; set by proxy.api).
COOKIE = "phasewatch_key"
_COOKIE_SALT = b"phasewatch page cookie v1"
_COOKIE_PREFIX = COOKIE.encode() + b"="


def page_token(key: bytes) -> str:
    """The cookie value for a key: derived from it, so the cookie jar never holds the key,
    and the same in every worker and after a restart (a changed key ends it)."""
    return hmac.new(key, _COOKIE_SALT, hashlib.sha256).hexdigest()


class Access:
    """The proxy keys (some named after the client that holds them) and the engines' keys."""

    def __init__(
        self,
        api_keys: list[str],
        upstream_keys: dict[str, str],
        key_clients: dict[str, str] | None = None,
    ) -> None:
        names = key_clients or {}
        #: (key, client name or "") for every proxy key
        self._keys = [(k.encode(), names.get(k, "")) for k in api_keys if k]
        #: (cookie token, client name) for every proxy key
        self._tokens = [(page_token(k).encode(), name) for k, name in self._keys]
        self._upstream = {name: ("Bearer " + key).encode() for name, key in upstream_keys.items()}

    @property
    def required(self) -> bool:
        """Whether clients must present a key at all."""
        return bool(self._keys)

    def allowed(self, headers: Iterable[tuple[bytes, bytes]], basic: bool = False) -> bool:
        """Whether the request carries a valid proxy key (always, when none are set).
        `basic`: also take HTTP Basic's password and the page cookie (the own API's pages,
        for browsers)."""
        return self.client(headers, basic) is not None

    def client(self, headers: Iterable[tuple[bytes, bytes]], basic: bool = False) -> str | None:
        """Who the request's key names: the client name of a named key, "" for a bare key
        or when no keys are set, None when a key is required and none valid was sent."""
        if not self._keys:
            return ""
        for k, v in headers:
            if k == b"authorization" and v[:7].lower() == b"bearer ":
                found = self._match(v[7:].strip())
            elif k == b"authorization" and basic and v[:6].lower() == b"basic ":
                try:
                    _, _, password = base64.b64decode(v[6:].strip(), validate=True).partition(b":")
                except (binascii.Error, ValueError):
                    continue
                found = self._match(password)
            elif k == b"x-api-key":
                found = self._match(v.strip())
            elif k == b"cookie" and basic:
                found = self._cookie(v)
            else:
                continue
            if found is not None:
                return found
        return None

    def _match(self, presented: bytes) -> str | None:
        """The client name of the key presented ("" for a bare key), None for no key;
        every key is compared, in constant time."""
        found = None
        for key, name in self._keys:
            if hmac.compare_digest(presented, key):
                found = name
        return found

    def page_cookie(self, presented: bytes) -> str | None:
        """The cookie value for a valid key presented to log in (``?key=``, the login
        form), None for an invalid one; compared like any key."""
        if self._match(presented) is None:
            return None
        return page_token(presented)

    def _cookie(self, header: bytes) -> str | None:
        """The client name of a valid page cookie in a Cookie header, else None."""
        found = None
        for part in header.split(b";"):
            name, sep, value = part.strip().partition(b"=")
            if not sep or name != COOKIE.encode():
                continue
            for token, client in self._tokens:  # every token compared, in constant time
                if hmac.compare_digest(value.strip(), token):
                    found = client
        return found

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]], upstream: str
    ) -> list[tuple[bytes, bytes]]:
        """The request headers as the engine should see them."""
        key = self._upstream.get(upstream)
        if key is None and not self._keys:
            return headers
        out = []
        for k, v in headers:
            if k == b"x-api-key" and self._keys and self._match(v.strip()) is not None:
                continue  # the phasewatch key: not the engine's business
            if k == b"authorization" and (
                key is not None
                or (v[:7].lower() == b"bearer " and self._match(v[7:].strip()) is not None)
            ):
                continue
            if k == b"cookie" and self._keys and _COOKIE_PREFIX in v:
                v = _without_page_cookie(v)  # a page cookie is not the engine's either
                if not v:
                    continue
            out.append((k, v))
        if key is not None:
            out.append((b"authorization", key))
        return out


def _without_page_cookie(header: bytes) -> bytes:
    """A Cookie header without phasewatch's own cookie."""
    parts = [p.strip() for p in header.split(b";")]
    return b"; ".join(p for p in parts if p and not p.startswith(_COOKIE_PREFIX))
