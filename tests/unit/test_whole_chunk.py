"""The lean transport's one-chunk reads (proxy.transport.wire.whole_chunk): a read that is
exactly one chunk of a chunked body skips the parser and reaches the relay's reader
(``Connection.relay``) with its framing, which the server may write as it came. Whatever
the reads' boundaries and the engine's framing (uppercase or zero-padded sizes,
extensions, a size line split across reads), the reader must get the body exactly, in
order, then its end, once; and only a chunk in the form the server writes itself may come
framed."""

from __future__ import annotations

import asyncio
import itertools
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.transport import connection, lean
from proxy.transport.wire import whole_chunk

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_whole_chunk_takes_only_the_canonical_form():
    assert whole_chunk(b"5\r\nhello\r\n") == b"hello"
    assert whole_chunk(b"d\r\n" + b"x" * 13 + b"\r\n") == b"x" * 13
    assert whole_chunk(b"7\r\na\r\nb\r\nc\r\n") == b"a\r\nb\r\nc"  # CRLF inside the body
    for other in (
        b"D\r\n" + b"x" * 13 + b"\r\n",  # uppercase
        b"05\r\nhello\r\n",  # zero-padded
        b"5;ext=1\r\nhello\r\n",  # an extension
        b"5\r\nhell",  # cut short
        b"5\r\nhello\r\n0\r\n\r\n",  # the last chunk follows
        b"5\r\nhello\r\n5\r\nworld\r\n",  # two chunks
        b"0\r\n\r\n",  # the last chunk itself
        b"5\r\nhelloXY",  # no CRLF after the body
        b"\r\nhello\r\n",
        b"",
    ):
        assert whole_chunk(other) is None, other


#: Pieces a read is made of: size lines of every form, CRLFs, bodies, the last chunk.
_PIECES = st.one_of(
    st.sampled_from([b"\r\n", b"\r", b"\n", b"0", b"5", b"d", b"D", b"05", b";x=1", b"0\r\n\r\n"]),
    st.integers(0, 0x2000).map(lambda n: b"%x\r\n" % n),
    st.integers(0, 0x200).map(lambda n: b"%X\r\n" % n),
    st.binary(max_size=40),
)


#: One chunk in the form a proxy writes itself: lowercase hex, no leading zero, no
#: extension (the definition, spelled as a pattern).
_CANONICAL = re.compile(rb"([1-9a-f][0-9a-f]*)\r\n(.*)\r\n", re.S)


def _reference(data: bytes) -> bytes | None:
    m = _CANONICAL.fullmatch(data)
    return m.group(2) if m and int(m.group(1), 16) == len(m.group(2)) else None


@settings(max_examples=2000, deadline=None)
@given(st.lists(_PIECES, max_size=8).map(b"".join))
def test_any_read_is_one_chunk_exactly_when_the_definition_says(data):
    assert whole_chunk(data) == _reference(data)


def test_whole_chunk_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        whole_chunk(bytearray(b"5\r\nhello\r\n"))  # type: ignore[arg-type]


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_any_one_chunk_is_taken_only_in_the_canonical_form(body):
    for size_line in (b"%x" % len(body), b"%X" % len(body), b"0%x" % len(body)):
        data = size_line + b"\r\n" + body + b"\r\n"
        assert whole_chunk(data) == _reference(data), data


class _Wire:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _feed(reads: list[bytes]) -> tuple[bytes, list[tuple[bytes, bytes | None]], bool]:
    async def run():
        pool = lean.LeanTransport()
        conn = connection.Connection(pool, ("http", "engine", 80))
        conn.connection_made(_Wire())  # type: ignore[arg-type]
        conn.start("POST", httpx.URL("http://engine/v1/chat/completions"), None, None)
        got: list[tuple[bytes, bytes | None]] = []
        ended: list[Exception | None] = []

        def read(body: bytes, framed: bytes | None) -> None:
            assert not ended
            got.append((body, framed))

        conn.relay(read, ended.append)
        for data in reads:
            conn.data_received(data)
        assert ended == ([None] if conn.complete else [])
        return b"".join(conn.chunks), got, conn.complete

    return asyncio.run(run())


def _size_lines(pieces: list[bytes], forms: list[int]) -> list[bytes]:
    """Each piece's size line, in the engine's form (uppercase, zero-padded, an extension
    or the canonical one)."""
    lines = []
    for piece, form in zip(pieces, forms):
        size = b"%x" % len(piece)
        lines.append((size.upper(), b"0" + size, size + b";x=y", size)[form % 4])
    return lines


def _chunked(pieces: list[bytes], forms: list[int]) -> bytes:
    lines = _size_lines(pieces, forms)
    return b"".join(s + b"\r\n" + p + b"\r\n" for s, p in zip(lines, pieces)) + b"0\r\n\r\n"


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
    st.lists(st.integers(0, 7), min_size=8, max_size=8),
    st.lists(st.integers(0, 400), max_size=10),
    st.booleans(),
)
def test_any_reads_give_the_body_exactly(pieces, forms, cuts, per_chunk):
    body = _chunked(pieces, forms)
    if per_chunk:  # one read per chunk, as a paced engine sends them (the head alone)
        reads = [HEAD]
        pos = 0
        for piece in pieces:
            end = body.index(b"\r\n", pos) + 2 + len(piece) + 2
            reads.append(body[pos:end])
            pos = end
        reads.append(body[pos:])
    else:
        wire = HEAD + body
        marks = sorted({min(c, len(wire)) for c in cuts} | {0, len(wire)})
        reads = [wire[a:b] for a, b in itertools.pairwise(marks) if b > a]
    rest, got, complete = _feed(reads)
    assert complete
    assert b"".join(b for b, _ in got) + rest == b"".join(pieces)
    for b, framed in got:
        assert framed is None or framed == b"%x\r\n%b\r\n" % (len(b), b)
    if per_chunk:
        # the canonical chunks, read one each, came framed
        lines = _size_lines(pieces, forms)
        canonical = sum(1 for s, p in zip(lines, pieces) if s == b"%x" % len(p))
        assert sum(1 for _, f in got if f is not None) == canonical


def test_a_chunk_whose_bytes_look_like_a_chunk_is_parsed():
    # a chunk, then the next one's size line, end a read; that chunk's own bytes, read
    # next, look like a whole chunk themselves, but the parser is inside it
    for reads, body in (
        ([HEAD, b"a\r\n", b"5\r\nhello\r\n", b"\r\n0\r\n\r\n"], b"5\r\nhello\r\n"),
        ([HEAD, b"1\r\nx\r\na\r\n", b"5\r\nhello\r\n", b"\r\n0\r\n\r\n"], b"x5\r\nhello\r\n"),
    ):
        rest, got, complete = _feed(reads)
        assert complete
        assert b"".join(b for b, _ in got) + rest == body


def test_a_size_line_split_across_reads_is_parsed():
    # "13" split after its "1": the next read looks like a whole chunk of size 3
    payload = b"abc\r\ndefghijklmnopq"
    assert len(payload) == 0x13
    reads = [HEAD, b"1\r\nx\r\n1", b"3\r\nabc\r\n", b"defghijklmnopq\r\n0\r\n\r\n"]
    rest, got, complete = _feed(reads)
    assert complete
    assert b"".join(b for b, _ in got) + rest == b"x" + payload
