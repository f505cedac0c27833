"""What one read of a streamed answer is, asked once: a plain token event or not.

A paced engine writes one event per read, nearly all of them token deltas. The SSE tap
asks each read the same questions (one whole single-line event? ``data: {"`` and not an
error? no usage key? no finish reason but one ``null``? output, by substring?) and, for
a plain token event, forwards it as it came. :func:`token_kind` answers them all in one
call: in C where it was built (``_sse.c``, a tenth of the cost: in CPython 3.11 each
bytes search or slice the Python version makes costs more in argument parsing and
objects than in searching), else as :func:`token_kind_py`, the reference. Tests hold
the two to the same answers on any input.
"""

from __future__ import annotations

#: Not a plain token event: the tap's general path decides what it is.
GENERAL = -1
#: A plain token event carrying output (a non-empty "content" or "text").
OUTPUT = 1
#: A plain token event that only the output pattern can tell about (an empty content,
#: a tool call, reasoning, spaced JSON).
PATTERN = 2

_FINISH_KEY = b'"finish_reason":'


def token_kind_py(chunk: bytes) -> int:
    """GENERAL, OUTPUT or PATTERN for one read (see the module)."""
    n = len(chunk)
    if chunk.find(b"\n") != n - 2 or chunk[-1:] != b"\n" or chunk.find(b"\r") >= 0:
        return GENERAL  # not one single-line, LF-only event
    if chunk[:8] != b'data: {"' or chunk[8:14] == b'error"':
        return GENERAL
    if chunk.find(b'"usage":') >= 0:
        return GENERAL
    i = chunk.find(_FINISH_KEY)
    if i >= 0 and (chunk[i + 16 : i + 20] != b"null" or chunk.find(_FINISH_KEY, i + 16) >= 0):
        return GENERAL
    i = chunk.find(b'"content":"')
    if i >= 0 and chunk[i + 11 : i + 12] != b'"':
        return OUTPUT
    i = chunk.find(b'"text":"')
    if i >= 0 and chunk[i + 8 : i + 9] != b'"':
        return OUTPUT
    return PATTERN


try:
    from ._sse import token_kind
except ImportError:  # built without a compiler: the same answers, in Python
    token_kind = token_kind_py
