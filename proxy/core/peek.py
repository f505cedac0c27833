"""A large JSON request body, read for what routing and measurement need without parsing
it whole on the event loop.

The route (the model a body names), the affinity key (the prompt's leading bytes) and the
dialect's ``prepare`` (whether it streams, whether usage may be injected) each read a
request body as JSON. ``json.loads`` of a 44 MiB body holds the event loop (and the GIL:
a thread would not help) for most of a second and builds an object about five times the
body's size. So a body over :data:`LARGE` is first reduced to a small JSON document of
the same shape: every string cut to its first :data:`CAP` bytes, every list cut after
:data:`KEEP` bytes of items (its first item always kept, so what is non-empty stays
non-empty); objects keep every member (the model may come last, a message's role after
its content). The reduction is one pass over the bytes, in slices that yield to the loop, and its
output is bounded (:data:`MOST`); what the readers parse is that. Everything they read
lies within those bounds (a model name, flags, the first KiBs of the prompt), so they
read what they would have read from the whole body. The body sent upstream is the
client's own, never the reduction.

A body whose reduction would still be large (objects with a vast number of members,
nesting deeper than :data:`DEPTH`) is read as unreadable, as malformed JSON is:
no model, no prefix, passed on as it came. A body that is not JSON reduces to something
that does not parse either.
"""

from __future__ import annotations

import asyncio
import re

#: Bodies up to this size are parsed as they are (a few milliseconds at most).
LARGE = 1024 * 1024
#: Bytes kept of each string (its source, escapes included).
CAP = 64 * 1024
#: Bytes of items after which a list keeps no more.
KEEP = 64 * 1024
#: Largest reduction; beyond it the body is read as unreadable.
MOST = 4 * 1024 * 1024
#: Deepest nesting reduced.
DEPTH = 256
#: Bytes scanned, and tokens read, between two yields to the event loop.
SLICE = 1024 * 1024
TURNS = 2048

_WS = re.compile(rb"[ \t\r\n]*")
#: A string's inside: plain runs and escapes, up to its closing quote (or the slice's end).
_INSIDE = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.DOTALL)
#: A string's inside cut to complete escapes (``\uXXXX`` whole).
_UNITS = re.compile(rb'(?:[^"\\]+|\\u[0-9a-fA-F]{4}|\\[^u])*', re.DOTALL)
#: Anything that is neither a bracket nor the start of an unfinished string: skipped whole.
_SKIP = re.compile(rb'(?:[^"\[\]{}]+|"[^"\\]*(?:\\.[^"\\]*)*")+', re.DOTALL)
_SCALAR = re.compile(rb"-?Infinity|NaN|[-+0-9.eE]+|true|false|null")


async def reduced(body: bytes) -> bytes:
    """What routing and ``prepare`` parse of `body`: the body itself when it is small,
    else its reduction (see the module's docstring); b"" when it is unreadable."""
    if len(body) <= LARGE:
        return body
    r = _Reducer(body)
    while not r.step():
        await asyncio.sleep(0)
    return r.result()


class _Frame:
    __slots__ = ("close", "dropping", "skip", "start", "whole")

    def __init__(self, close: bytes, start: int, whole: bool) -> None:
        self.close = close
        self.start = start  # output size when it opened
        self.whole = whole  # an object: every member kept
        self.dropping = False  # past KEEP: members are skipped to the close
        self.skip = 0  # brackets open inside the skipped members


class _Reducer:
    """One pass over a body, a slice per :meth:`step`."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.pos = 0
        self.out: list[bytes] = []
        self.size = 0
        self.stack: list[_Frame] = []
        self.failed = False
        self.started = False
        self.finished = False
        self.string: int | None = None  # where the open string's inside began
        self.dropped = False  # the open string is dropped (in a frame past KEEP)

    def result(self) -> bytes:
        return b"" if self.failed else b"".join(self.out)

    def _emit(self, piece: bytes) -> None:
        self.out.append(piece)
        self.size += len(piece)
        if self.size > MOST:
            self.failed = True

    def step(self) -> bool:
        """Scan one slice; True when done."""
        body, end = self.body, len(self.body)
        stop = min(end, self.pos + SLICE)
        turns = TURNS
        while not (self.failed or self.finished):
            turns -= 1
            if not turns:
                return False
            if self.string is not None:  # inside a long string: find its end
                self.pos = _run(_INSIDE, body, self.pos, stop)
                if self.pos >= end:
                    return self._fail()
                if body[self.pos] != 0x22:  # the slice ended inside it
                    if self.pos + 1 >= stop and body[self.pos] == 0x5C:
                        self.pos = min(end, self.pos + 2)  # an escape across the slice
                    if self.pos >= stop:
                        return False
                    continue
                self._end_string()
                continue
            if self.pos < stop:
                self.pos = _run(_WS, body, self.pos, stop)
            if self.pos >= stop:
                if stop >= end:
                    return self._fail()  # the body ended inside its value
                return False
            frame = self.stack[-1] if self.stack else None
            if frame is not None and frame.dropping:
                self._drop(frame, stop)
                continue
            c = body[self.pos : self.pos + 1]
            if c == b'"':
                self.pos += 1
                self.string = self.pos
            elif c in b"{[" and len(c) == 1:
                if not self.stack and self.started:
                    return self._fail()  # a second value after the first
                self.started = True
                if len(self.stack) >= DEPTH:
                    return self._fail()
                self._emit(c)
                # an object keeps every member (its keys matter); a list is cut
                self.stack.append(_Frame(b"}" if c == b"{" else b"]", self.size, c == b"{"))
                self.pos += 1
            elif c in b"}]" and len(c) == 1:
                self._close(c)
            elif c == b",":
                self.pos += 1
                if frame is not None and not frame.whole and self.size - frame.start >= KEEP:
                    frame.dropping = True
                else:
                    self._emit(c)
            elif c == b":":
                self.pos += 1
                self._emit(c)
            else:
                m = _SCALAR.match(body, self.pos, stop)
                if m is None and stop < end and stop - self.pos < 10:
                    return False  # a literal across the slice's end: read on
                if m is None or not self.stack:
                    return self._fail()
                self._emit(m.group())
                self.pos = m.end()
        if self.finished and _run(_WS, body, self.pos, end) != end:
            self.failed = True  # something after the top-level value
        return True

    def _fail(self) -> bool:
        self.failed = True
        return True

    def _end_string(self) -> None:
        """The open string ends at `pos` (its closing quote): kept up to CAP bytes."""
        start = self.string
        assert start is not None
        self.string = None
        if self.dropped:
            self.dropped = False
            self.pos += 1
            return
        if not self.stack:
            self.failed = True  # a bare string is no request body
            return
        if self.pos - start > CAP:
            cut = _run(_UNITS, self.body, start, start + CAP)
            cut = _utf8_whole(self.body, start, cut)
        else:
            cut = self.pos
        self._emit(b'"' + self.body[start:cut] + b'"')
        self.pos += 1

    def _close(self, c: bytes) -> None:
        frame = self.stack.pop() if self.stack else None
        if frame is None or frame.close != c:
            self.failed = True
            return
        self._emit(c)
        self.pos += 1
        if not self.stack:
            self.finished = True

    def _drop(self, frame: _Frame, stop: int) -> None:
        """Skip what follows in a frame past KEEP, up to its close."""
        body = self.body
        m = _SKIP.match(body, self.pos, stop)
        if m is not None:
            self.pos = m.end()
            return
        c = body[self.pos : self.pos + 1]
        if c == b'"':  # a string the slice does not hold whole: read on, dropped
            self.pos += 1
            self.string = self.pos
            self.dropped = True
        elif c in b"[{":
            frame.skip += 1
            self.pos += 1
        elif frame.skip:
            frame.skip -= 1
            self.pos += 1
        else:
            frame.dropping = False
            self._close(c)


def _run(pattern: re.Pattern[bytes], body: bytes, pos: int, stop: int) -> int:
    """Where `pattern` (one that may match nothing) stops matching from `pos`."""
    m = pattern.match(body, pos, stop)
    return pos if m is None else m.end()


def _utf8_whole(body: bytes, start: int, cut: int) -> int:
    """`cut` moved back so no UTF-8 character is split at it."""
    for back in range(1, 4):
        i = cut - back
        if i < start:
            break
        b = body[i]
        if b < 0x80:
            break
        if b >= 0xC0:  # a lead byte: its character's length
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return i if back < need else cut
    return cut
