"""Where events end in a byte stream: SSE's blank lines, NDJSON's newlines.

Server-sent events end at a blank line, and ``\\n``, ``\\r\\n`` and ``\\r`` all end a
line, in any mix, chosen by each writer (sse-starlette sends ``\\r\\n``); a chunk from the
network may end anywhere, inside a line or between the two bytes of a ``\\r\\n``.
:class:`Framer` finds every boundary as the bytes arrive, per chunk:

- linearly: each byte is searched once; a boundary cut between two chunks is found by
  re-reading at most the last three bytes held, and an unfinished event is kept as a
  list of the chunks it arrived in (never copied until it is whole);
- boundedly: an event that grows past ``limit`` bytes is not held any longer. Its bytes
  come out as :class:`Raw` pieces, as they arrive, until the event ends; the tap passes
  them through without looking at them (``oversized`` counts such events).
"""

from __future__ import annotations

import json
import re

#: One line terminator, then another: the blank line that ends an SSE event. Atomic
#: groups keep a ``\r\n`` whole (it must not be read as ``\r`` then an empty ``\n``).
_SSE_END = re.compile(rb"(?>\r\n|\r|\n)(?>\r\n|\r|\n)")

#: Most bytes an event may have before the tap stops holding it for measurement.
MAX_EVENT_BYTES = 1024 * 1024


def _crlf_only(data: bytes, start: int) -> bool:
    """Whether every line of `data[start:]` ends with CRLF (and none is cut in two)."""
    n = data.count(b"\r\n", start)
    return n == data.count(b"\r", start) == data.count(b"\n", start)


class Raw(bytes):
    """Bytes of an oversized event: forwarded as they come, never looked at."""

    __slots__ = ()


class Framer:
    """Splits a byte stream into whole events (each with its terminator), holding at most
    `limit` bytes of an unfinished one. ``lines``: NDJSON (one event per ``\\n``)."""

    __slots__ = (
        "_held",
        "_held_size",
        "_skip",
        "_tail",
        "limit",
        "lines",
        "oversized",
        "passed",
        "whole",
    )

    def __init__(self, limit: int = MAX_EVENT_BYTES, lines: bool = False) -> None:
        self.limit = limit
        self.lines = lines
        self._held: list[bytes] = []  # the chunks of the unfinished event
        self._held_size = 0
        self._tail = b""  # the last bytes (at most 3) held or passed through raw
        self._skip = False  # inside an oversized event: its bytes pass through raw
        self.oversized = 0  # events that were too large to hold
        self.passed = False  # the last split() returned Raw pieces
        self.whole = False  # the last split()'s pieces were exactly its chunk

    # --- splitting ----------------------------------------------------------------------

    def holding(self) -> bool:
        """Whether anything of an unfinished event is held (or an oversized one is being
        passed through), or the stream is NDJSON: a read cannot be taken as it is."""
        return bool(self._held or self._skip or self.lines)

    def split(self, chunk: bytes) -> list[bytes]:
        """The pieces of `chunk` (and of what was held before it) that are ready: whole
        events, and Raw pieces of an oversized one, in stream order. Returns an empty
        list while an event is unfinished; its bytes stay held."""
        pieces: list[bytes] = []
        self.passed = self.whole = False
        if not self._held and not self._skip and not self.lines and chunk.find(b"\r") < 0:
            # the hot path (LF-only SSE, nothing held): the search inlined; a read that is
            # one whole event (how engines write them) costs one search
            find = chunk.find
            i = find(b"\n\n")
            if i >= 0 and i == len(chunk) - 2:
                self.whole = True
                pieces.append(chunk)
                return pieces
            start = 0
            append = pieces.append
            while i >= 0:
                append(chunk[start : i + 2])
                start = i + 2
                i = find(b"\n\n", start)
            if start == len(chunk):
                self.whole = True
                return pieces
            self._hold(chunk[start:] if start else chunk, pieces)
            return pieces
        if self._skip:
            chunk = self._skip_event(chunk, pieces)
            if not chunk:
                return pieces
        elif not self._held:
            start = self._events(chunk, 0, pieces)
            if start == len(chunk):
                self.whole = True
                return pieces
            self._hold(chunk[start:] if start else chunk, pieces)
            return pieces
        if self._held:
            start = self._join_held(chunk, pieces)
            if start < 0:  # still unfinished
                self._hold(chunk, pieces)
                return pieces
        else:
            start = 0
        start = self._events(chunk, start, pieces)
        if start < len(chunk):
            self._hold(chunk[start:] if start else chunk, pieces)
        return pieces

    def _events(self, data: bytes, start: int, pieces: list[bytes]) -> int:
        """Append every whole event of `data` from `start`; return where the rest begins."""
        append = pieces.append
        if self.lines:
            find = data.find
            while (i := find(b"\n", start)) >= 0:
                append(data[start : i + 1])
                start = i + 1
        elif data.find(b"\r", start) < 0:  # the common case: LF only, one fast search
            find = data.find
            while (i := find(b"\n\n", start)) >= 0:
                append(data[start : i + 2])
                start = i + 2
        elif _crlf_only(data, start):  # CRLF only (sse-starlette): one fast search too
            find = data.find
            while (i := find(b"\r\n\r\n", start)) >= 0:
                append(data[start : i + 4])
                start = i + 4
        else:
            search = _SSE_END.search
            while (m := search(data, start)) is not None:
                end = m.end()
                append(data[start:end])
                start = end
        return start

    def _end_in(self, chunk: bytes) -> int:
        """Where in `chunk` the first event boundary ends, counting a boundary that began
        in the held bytes before it (-1: none)."""
        if self.lines:
            i = chunk.find(b"\n")
            return i + 1 if i >= 0 else -1
        tail = self._tail
        window = tail + chunk[:3] if tail else chunk[:3]
        m = _SSE_END.search(window)
        if m is not None and m.end() > len(tail):
            return m.end() - len(tail)
        if chunk.find(b"\r") < 0:
            i = chunk.find(b"\n\n")
            return i + 2 if i >= 0 else -1
        m = _SSE_END.search(chunk)
        return m.end() if m is not None else -1

    def _join_held(self, chunk: bytes, pieces: list[bytes]) -> int:
        """Finish the held event with the start of `chunk`, if it ends there; returns where
        in `chunk` the next event begins (-1: the held one is still unfinished)."""
        end = self._end_in(chunk)
        if end < 0:
            return -1
        self._held.append(chunk[:end])
        pieces.append(b"".join(self._held))
        self._held = []
        self._held_size = 0
        self._tail = b""
        return end

    def _hold(self, rest: bytes, pieces: list[bytes]) -> None:
        self._held.append(rest)
        self._held_size += len(rest)
        self._tail = (self._tail + rest)[-3:] if len(rest) < 3 else rest[-3:]
        if self._held_size > self.limit:  # too large to hold: pass it through from here
            raw = b"".join(self._held)
            self._held = []
            self._held_size = 0
            self._skip = True
            self.oversized += 1
            self.passed = True
            pieces.append(Raw(raw))

    def _skip_event(self, chunk: bytes, pieces: list[bytes]) -> bytes:
        """Pass the oversized event's bytes in `chunk` through; returns what follows it."""
        end = self._end_in(chunk)
        self.passed = True
        if end < 0:
            pieces.append(Raw(chunk))
            self._tail = (self._tail + chunk)[-3:]
            return b""
        pieces.append(Raw(chunk[:end]))
        self._skip = False
        self._tail = b""
        return chunk[end:]

    # --- the end of the stream ----------------------------------------------------------

    def take(self) -> bytes:
        """The unfinished event's bytes, no longer held (empty when there is none)."""
        rest = b"".join(self._held)
        self._held = []
        self._held_size = 0
        if rest:
            self._tail = b""
        return rest

    @property
    def in_raw(self) -> bool:
        """Whether an oversized event was being passed through and has not ended."""
        return self._skip

    def complete(self, rest: bytes) -> bool:
        """Whether an unfinished event could stand as a whole one: every SSE line of it
        ended; an NDJSON line that is a whole JSON value."""
        if not self.lines:
            return rest[-1:] in (b"\n", b"\r")
        try:
            json.loads(rest)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return False
        return True

    def closer(self, last: bytes) -> bytes:
        """What to send after `last` (the last bytes forwarded) so that the stream is at
        an event boundary, ready for an event of the proxy's own."""
        if self.lines:
            return b"" if not last or last[-1:] == b"\n" else b"\n"
        if not last:
            return b""
        m = _SSE_END.search(last[-4:])
        if m is not None and m.end() == len(last[-4:]):
            return b""  # already at a blank line
        if last[-1:] == b"\n":
            return b"\r\n" if last[-2:] == b"\r\n" else b"\n"
        if last[-1:] == b"\r":
            return b"\r\n"  # a bare \n here would be read as the end of the same \r\n
        return b"\n\n"  # cut inside a line (an oversized event): end it, then the event

    @property
    def last(self) -> bytes:
        """The last bytes passed through raw (for :meth:`closer`)."""
        return self._tail
