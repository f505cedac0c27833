"""Who may use the proxy, and which credentials reach the engine.

With proxy keys configured, a client must present one (``Authorization: Bearer KEY`` or
``x-api-key: KEY``). The engine then gets the key configured for its upstream, if any;
a phasewatch key is never passed on to an engine. With no proxy keys, the client's own
``Authorization`` reaches the engine unless an upstream key replaces it. Keys are
compared in constant time and never logged or exported. A key may be named after the
client holding it (``--api-key team-a=KEY``): its requests are labelled ``client=team-a``.
Keys may come from files, one a line (``--api-key-file``, ``--api-key @FILE``: read at
start by :mod:`proxy.settings`); here every key is a key, never a path.

Browsers reach the own pages with HTTP Basic (any user name, the key as password) or with
a cookie set from a ``?key=`` link or the login form: the cookie holds its expiry and a
MAC of the key and the expiry under a secret made at start (never the key), taken on the
own pages only, never by the relay, for ``--page-cookie-ttl`` at most. A restart or a
changed key ends every cookie.

Wrong keys are throttled per client address (``--max-key-failures`` a minute, a bucket
that refills): beyond it, whatever key the address presents (Bearer, ``x-api-key``, Basic,
the login form, ``?key=``) is refused with 429 unchecked until the bucket has room, so a
client cannot guess keys at wire speed. A page cookie is not a guess and is not refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from urllib.parse import unquote_to_bytes

from .asgi import Scope
from .refusals import Refusal

#: The own pages' cookie (HttpOnly, SameSite=Strict; set by proxy.api).
COOKIE = "phasewatch_key"
_COOKIE_PREFIX = COOKIE.encode() + b"="
#: The ASGI scope entry where the relay puts the name of the API key a request presented
#: (absent for a bare key or none): who holds the request, for limits that are fair
#: between clients (the server's stalled-stream cap).
CLIENT_SCOPE = "phasewatch.key_client"
#: Client addresses whose wrong keys are remembered (the oldest is forgotten first).
MAX_ADDRESSES = 4096


class Throttled(Exception):
    """The client's address presented too many wrong keys: refuse for `retry_after` s."""

    def __init__(self, retry_after: float) -> None:
        super().__init__("too many wrong keys")
        self.retry_after = retry_after


class Guesses:
    """Wrong keys per client address: a bucket of `per_minute` that refills evenly.
    Bounded: at most MAX_ADDRESSES addresses, the one idle longest forgotten first."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, peer: str, now: float) -> float:
        """The wrong keys the address has left now (0..per_minute)."""
        got = self._buckets.get(peer)
        if got is None:
            return float(self.per_minute)
        left, at = got
        return min(float(self.per_minute), left + (now - at) * self.per_minute / 60.0)

    def check(self, peer: str | None) -> None:
        """Raise Throttled while the address has no wrong key left."""
        if peer is None or self.per_minute <= 0 or peer not in self._buckets:
            return
        level = self._level(peer, self.clock())
        if level < 1.0:
            raise Throttled((1.0 - level) * 60.0 / self.per_minute)

    def failed(self, peer: str | None) -> None:
        """The address presented a wrong key."""
        if peer is None or self.per_minute <= 0:
            return
        now = self.clock()
        level = self._level(peer, now) - 1.0
        self._buckets[peer] = (level, now)
        self._buckets.move_to_end(peer)
        if len(self._buckets) > MAX_ADDRESSES:
            self._buckets.popitem(last=False)


def peer_of(scope: Scope) -> str | None:
    """The client's address (without its port), the unit wrong keys are counted by."""
    client = scope.get("client")
    return str(client[0]) if client else None


def throttled(exc: Throttled, peer: str | None, per_minute: int) -> Refusal:
    """What an address out of wrong keys gets: 429 until its bucket has room."""
    wait = max(1, math.ceil(exc.retry_after))
    return Refusal(
        429,
        f"too many wrong phasewatch API keys from this address; retry in {wait}s",
        "rate_limit_exceeded",
        "key_guesses",
        "refused keys from %s for %ds: more than %d wrong keys a minute (--max-key-failures)",
        (peer or "unknown", wait, per_minute),
        ((b"retry-after", str(wait).encode()),),
    )


class Access:
    """The proxy keys (some named after the client that holds them) and the engines' keys."""

    def __init__(
        self,
        api_keys: list[str],
        upstream_keys: dict[str, str],
        key_clients: dict[str, str] | None = None,
        *,
        secret: bytes = b"",
        page_cookie_ttl: float = 12 * 3600,
        max_key_failures: int = 30,
        clock: Callable[[], float] = time.time,
    ) -> None:
        names = key_clients or {}
        #: (key, client name or "") for every proxy key
        self._keys = [(k.encode(), names.get(k, "")) for k in api_keys if k]
        #: The page cookie's MAC key: this start's secret (a restart ends every cookie).
        self._secret = secret or secrets.token_bytes(32)
        self.page_cookie_ttl = page_cookie_ttl
        self._clock = clock
        self._upstream = {name: ("Bearer " + key).encode() for name, key in upstream_keys.items()}
        #: Wrong keys per client address (--max-key-failures a minute).
        self.guesses = Guesses(max_key_failures)

    @property
    def required(self) -> bool:
        """Whether clients must present a key at all."""
        return bool(self._keys)

    def allowed(
        self, headers: Iterable[tuple[bytes, bytes]], basic: bool = False, peer: str | None = None
    ) -> bool:
        """Whether the request carries a valid proxy key (always, when none are set).
        `basic`: also take HTTP Basic's password and the page cookie (the own API's pages,
        for browsers); `peer`: as for :meth:`client`."""
        return self.client(headers, basic, peer) is not None

    def client(
        self, headers: Iterable[tuple[bytes, bytes]], basic: bool = False, peer: str | None = None
    ) -> str | None:
        """Who the request's key names: the client name of a named key, "" for a bare key
        or when no keys are set, None when a key is required and none valid was sent.
        With the client's address `peer`, a wrong key counts against it, and an address
        out of wrong keys raises Throttled for any key it presents (a valid page cookie
        still opens the pages)."""
        if not self._keys:
            return ""
        if peer is not None and self.guesses.per_minute > 0:
            if not isinstance(headers, list):
                headers = list(headers)
            if any(_guessable(k, v, basic) for k, v in headers):
                self.guesses.check(peer)
        presented = False
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
                if found is not None:
                    return found
                continue
            else:
                continue
            if found is not None:
                return found
            presented = True
        if presented:
            self.guesses.failed(peer)
        return None

    def _match(self, presented: bytes) -> str | None:
        """The client name of the key presented ("" for a bare key), None for no key;
        every key is compared, in constant time."""
        found = None
        for key, name in self._keys:
            if hmac.compare_digest(presented, key):
                found = name
        return found

    def page_cookie(self, presented: bytes, peer: str | None = None) -> str | None:
        """The cookie value for a valid key presented to log in (``?key=``, the login
        form), None for an invalid one (counted against `peer`); compared like any key.
        Raises Throttled for an address out of wrong keys."""
        self.guesses.check(peer)
        if self._match(presented) is None:
            self.guesses.failed(peer)
            return None
        expires = math.ceil(self._clock() + self.page_cookie_ttl)
        return f"{expires}.{self._mac(presented, expires)}"

    def _mac(self, key: bytes, expires: int) -> str:
        return hmac.new(self._secret, b"%d|" % expires + key, hashlib.sha256).hexdigest()

    def _cookie(self, header: bytes) -> str | None:
        """The client name of a valid, unexpired page cookie in a Cookie header, else
        None."""
        found = None
        for part in header.split(b";"):
            name, sep, value = part.strip().partition(b"=")
            if not sep or name != COOKIE.encode():
                continue
            stamp, dot, mac = value.strip().partition(b".")
            if not dot or not stamp.isdigit() or len(stamp) > 12:
                continue
            expires = int(stamp)
            if expires < self._clock():
                continue
            for key, client in self._keys:  # every key's MAC compared, in constant time
                if hmac.compare_digest(mac, self._mac(key, expires).encode()):
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


def _guessable(name: bytes, value: bytes, basic: bool) -> bool:
    """Whether a header presents a key that could be a guess (not a page cookie)."""
    if name == b"authorization":
        scheme = value[:7].lower()
        return scheme == b"bearer " or (basic and scheme[:6] == b"basic ")
    return name == b"x-api-key"


def strip_key_param(qs: bytes) -> bytes:
    """A query string without phasewatch's own ``key`` parameter (however it is
    percent-encoded): it is the page login's, never the engine's."""
    kept = []
    for part in qs.split(b"&"):
        name = part.split(b"=", 1)[0]
        if b"%" in name or b"+" in name:
            name = unquote_to_bytes(name.replace(b"+", b" "))
        if name != b"key":
            kept.append(part)
    return b"&".join(kept)


def _without_page_cookie(header: bytes) -> bytes:
    """A Cookie header without phasewatch's own cookie."""
    parts = [p.strip() for p in header.split(b";")]
    return b"; ".join(p for p in parts if p and not p.startswith(_COOKIE_PREFIX))
