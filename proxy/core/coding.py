"""Content codings of an engine's response, decoded on the side to measure it.

An engine (or a gateway in front of it) may compress its answer when the client accepts
it. Where the coding is one the standard library decodes (gzip, deflate), the relay
decodes a copy incrementally, in bounded pieces, and feeds those to the tap: the client
still gets the engine's compressed bytes unchanged, and the stream is measured. Where
phasewatch injected a usage request and the engine compressed anyway, the decoded stream
is what the tap strips and what the client gets (without the coding: identity is always
acceptable). A coding it cannot decode (``br``, ``zstd``) passes through unmeasured.

An engine's answer can be a decompression bomb (a few KiB that decode to GiBs), so
decoding is bounded in time and in size: it lets the event loop run after every
:data:`SLICE` decoded bytes (a stream's read and a kept whole body alike), stops at a
decoded-size cap (``--max-decoded-bytes`` for a stream, the kept size for a whole body),
and more than :data:`MAX_CODINGS` codings stacked on one body are not decoded at all: no
engine sends them.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Iterable, Iterator

from ..engines import Tap

#: Largest piece of decoded output produced at once (a small compressed chunk may
#: expand a thousandfold: it is decoded and handed on a piece at a time).
PIECE = 64 * 1024

#: Decoded bytes between two yields to the event loop.
SLICE = 1024 * 1024
#: Codings stacked on one body that are decoded: an engine (or a gateway) applies one.
MAX_CODINGS = 1
#: Default cap of a stream's decoded bytes (--max-decoded-bytes).
MAX_DECODED = 64 * 1024 * 1024

#: Codings the standard library decodes.
_ZLIB = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": zlib.MAX_WBITS}
#: Input kept while a deflate body may still turn out to be raw deflate (no zlib header).
_SNIFF = 1024


class Undecodable(Exception):
    """The body is not valid in its declared coding."""


def codings(raw_headers: Iterable[tuple[bytes, bytes]]) -> list[bytes]:
    """The content codings applied to a body, in the order applied (identity left out)."""
    out: list[bytes] = []
    for k, v in raw_headers:
        if k.lower() == b"content-encoding":
            for token in v.split(b","):
                token = token.strip().lower()
                if token and token != b"identity":
                    out.append(token)
    return out


def decodable(applied: list[bytes]) -> bool:
    return bool(applied) and not stacked(applied) and all(c in _ZLIB for c in applied)


def stacked(applied: list[bytes]) -> bool:
    """More codings than any engine applies: refused (not decoded) whatever they are."""
    return len(applied) > MAX_CODINGS


class _Step:
    """One coding, decoded incrementally: gzip (members one after another), deflate
    (zlib-wrapped, or raw as some servers send it)."""

    __slots__ = ("_d", "_out", "_seen", "_wbits")

    def __init__(self, coding: bytes) -> None:
        self._wbits = _ZLIB[coding]
        self._d = zlib.decompressobj(self._wbits)
        self._out = False  # produced output yet
        self._seen: bytes | None = b"" if self._wbits == zlib.MAX_WBITS else None

    def decode(self, data: bytes) -> Iterator[bytes]:
        if self._seen is not None and not self._out:
            self._seen += data
            if len(self._seen) > _SNIFF:
                self._seen = None
        while True:
            d = self._d
            try:
                out = d.decompress(data, PIECE)
            except zlib.error as exc:
                if self._seen is not None and not self._out:  # raw deflate: start over
                    data, self._seen = self._seen, None
                    self._d = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise Undecodable(str(exc)) from None
            data = d.unconsumed_tail
            if out:
                self._out = True
                yield out
            if d.eof:
                rest = d.unused_data
                if not rest or self._wbits != 16 + zlib.MAX_WBITS:
                    return  # what follows the end of a deflate body is ignored
                self._d = zlib.decompressobj(self._wbits)  # the next gzip member
                data = rest
                continue
            if not out and not data:
                return

    def flush(self) -> bytes:
        try:
            return self._d.flush()
        except zlib.error as exc:
            raise Undecodable(str(exc)) from None


class Decoder:
    """The codings of one body undone in reverse order, fed chunk by chunk; every piece
    it yields is at most :data:`PIECE` bytes (per step)."""

    __slots__ = ("_steps",)

    def __init__(self, applied: list[bytes]) -> None:
        self._steps = [_Step(c) for c in reversed(applied)]

    def decode(self, chunk: bytes) -> Iterator[bytes]:
        return self._through(0, chunk)

    def _through(self, i: int, data: bytes) -> Iterator[bytes]:
        if i == len(self._steps):
            yield data
            return
        for piece in self._steps[i].decode(data):
            yield from self._through(i + 1, piece)

    def flush(self) -> Iterator[bytes]:
        for i, step in enumerate(self._steps):
            rest = step.flush()
            if rest:
                yield from self._through(i + 1, rest)


async def decode_whole(applied: list[bytes], body: bytes, limit: int) -> tuple[bytes | None, bool]:
    """A kept whole body decoded, up to `limit` decoded bytes, yielding to the loop after
    every :data:`SLICE`: (the decoded bytes, None when it does not decode; whether it
    went past `limit`). What is past the limit is not decoded at all."""
    dec = Decoder(applied)
    out: list[bytes] = []
    size = since = 0
    try:
        for part in (dec.decode(body), dec.flush()):
            for piece in part:
                out.append(piece)
                size += len(piece)
                if size >= limit:
                    over = size > limit or _more(dec, part)
                    out[-1] = piece[: len(piece) - (size - limit)]
                    return b"".join(out), over
                since += len(piece)
                if since >= SLICE:
                    since = 0
                    await asyncio.sleep(0)
    except Undecodable:
        return None, False
    return b"".join(out), False


def _more(dec: Decoder, part: Iterator[bytes]) -> bool:
    """Whether a decoder stopped at its limit had more to give."""
    try:
        return any(True for _ in part) or any(True for _ in dec.flush())
    except Undecodable:
        return False


class Decoded:
    """A tap fed the decoded body. `exact`: the client gets the engine's bytes as they
    came (the decoded copy is only measured); otherwise it gets what the tap lets
    through of the decoded stream. Either way a read is decoded a bounded piece at a
    time (a small chunk that decodes to a great deal never sits in memory whole), at
    most :data:`SLICE` decoded bytes a :meth:`step` (the caller lets the loop run
    between steps), and no further than `limit` decoded bytes. After the body stops
    decoding, `broken` says why (`over`: it reached the limit) and nothing more is
    measured."""

    __slots__ = ("_dec", "_pending", "broken", "exact", "limit", "over", "size", "tap")

    def __init__(
        self, tap: Tap, applied: list[bytes], exact: bool, limit: int = MAX_DECODED
    ) -> None:
        self.tap = tap
        self.exact = exact
        self.limit = limit
        self._dec = Decoder(applied)
        self._pending: Iterator[bytes] | None = None
        self.broken: str | None = None
        self.over = False
        self.size = 0  # decoded bytes so far

    def take(self, chunk: bytes) -> None:
        """`chunk` is the body's next read, decoded by the :meth:`step` calls that
        follow (the one before must have said it was done)."""
        if self.broken is None:
            self._pending = self._dec.decode(chunk)

    def step(self, now: float) -> tuple[list[bytes], bool]:
        """Decode at most :data:`SLICE` more bytes of the pending read: what the tap lets
        through of them, and whether more of the read is pending."""
        pending = self._pending
        outs: list[bytes] = []
        if pending is None:
            return outs, False
        feed = self.tap.feed
        since = 0
        try:
            for piece in pending:
                if not self._count(len(piece)):
                    break
                out = feed(piece, now)
                if out:
                    outs.append(out)
                since += len(piece)
                if since >= SLICE:
                    return outs, True
        except Undecodable as exc:
            self.broken = str(exc)[:200]
        self._pending = None
        return outs, False

    def _count(self, n: int) -> bool:
        """Count `n` more decoded bytes; False (and nothing more decoded) past the limit."""
        self.size += n
        if self.size > self.limit:
            self.over = True
            self.broken = f"decoded past --max-decoded-bytes ({self.limit})"
            return False
        return True

    def end(self, now: float) -> bytes:
        out: list[bytes] = []
        if self.broken is None:
            feed = self.tap.feed
            try:
                for piece in self._dec.flush():
                    if not self._count(len(piece)):
                        break
                    out.append(feed(piece, now))
            except Undecodable as exc:
                self.broken = str(exc)[:200]
        tail = self.tap.end(now)
        return b"" if self.exact else b"".join(out) + tail
