"""The request path, normalised once, before anything routes, measures or forwards it.

Routing on one spelling of a path while the engine reads another lets a request slip past
the gate and the metrics (``/v1/./chat/completions``, ``/v1/chat/%63ompletions``), and
dot segments would climb out of an upstream's base path (``/v1/../../admin`` on an
upstream ``http://host/tenant-a``). So the path is normalised here, once, and the
normalised path is what the proxy routes and measures on and what the engine receives:

- percent-encoded unreserved characters are decoded (RFC 3986 §6.2.2.2: ``%63`` is ``c``,
  ``%2E`` is ``.``), and the remaining percent-encodings are upper-cased;
- dot segments are removed (RFC 3986 §5.2.4), so the path can never rise above ``/``,
  which the relay appends to the upstream's base path;
- empty segments are collapsed (``//v1/chat/completions``): no engine gives them a
  meaning, and some routers ignore them;
- a segment that still spells a dot segment once fully decoded, or with ``\\`` read as
  ``/`` (``..%2F``, ``..\\``), is refused (:class:`BadPath`): an engine that decodes
  ``%2F`` before routing would climb with it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, unquote_to_bytes

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PCT = re.compile(rb"%([0-9A-Fa-f]{2})")
#: Bytes never allowed raw in a path: controls, space, DEL, anything beyond ASCII.
_BAD_BYTES = re.compile(rb"[\x00-\x20\x7f-\xff]")


class BadPath(ValueError):
    """A request path the proxy will not forward."""


def _decode_unreserved(m: re.Match[bytes]) -> bytes:
    byte = int(m.group(1), 16)
    if byte in _UNRESERVED:
        return bytes((byte,))
    return b"%" + m.group(1).upper()


def remove_dot_segments(segments: list[bytes]) -> list[bytes]:
    """RFC 3986 §5.2.4 on a path split at '/' (without its leading empty segment);
    empty segments are dropped too. A trailing '.' or '..' leaves a trailing slash."""
    out: list[bytes] = []
    for seg in segments:
        if seg == b"..":
            if out:
                out.pop()
        elif seg not in (b".", b""):
            out.append(seg)
    return out


def normalise(raw_path: bytes) -> tuple[bytes, str]:
    """(raw path, decoded path) of a request path, normalised as the module says.
    Raises BadPath for a path that is not an absolute path."""
    if not raw_path.startswith(b"/") or _BAD_BYTES.search(raw_path) is not None:
        raise BadPath("the request path must be an absolute path of URI characters")
    if raw_path.find(b"%") >= 0:
        raw_path = _PCT.sub(_decode_unreserved, raw_path)
        if _PCT.sub(b"", raw_path).find(b"%") >= 0:
            raise BadPath("the request path has a malformed percent-encoding")
    segments = raw_path.split(b"/")[1:]
    trailing = segments[-1:] in ([b""], [b"."], [b".."])
    kept = remove_dot_segments(segments)
    for seg in kept:
        if seg.find(b"%") >= 0 or seg.find(b"\\") >= 0:  # some engines read %2F, or '\\', as '/'
            decoded = unquote_to_bytes(seg).replace(b"\\", b"/")
            if any(part in (b".", b"..") for part in decoded.split(b"/")):
                raise BadPath("the request path hides a dot segment in an encoded slash")
    path = b"/" + b"/".join(kept)
    if trailing and kept:
        path += b"/"
    text = path.decode("ascii")
    return path, unquote(text) if "%" in text else text
