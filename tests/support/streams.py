"""Feeding taps in tests: cut a byte stream at arbitrary points, run a tap over the pieces."""

from __future__ import annotations


def splits(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the given offsets (taken modulo its length; any order, repeats ok)."""
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for c in cuts + [len(data)]:
        out.append(data[prev:c])
        prev = c
    return out


def run(tap, chunks, start: float = 100.0, step: float = 0.01) -> bytes:
    """Feed `chunks` to `tap` at `start`, `start + step`, ...; return what it forwards."""
    out = [tap.feed(c, start + i * step) for i, c in enumerate(chunks)]
    out.append(tap.flush())
    return b"".join(out)
