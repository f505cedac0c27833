"""The metadata of a GGUF file (llama.cpp's model format), read from its header only.

A model's KV-cache shape (``{arch}.block_count``, ``attention.head_count_kv``,
``attention.key_length``, ``attention.sliding_window`` ...) sits in the key/value section
at the start of the file. The ``gguf`` package's reader maps the whole file and turns every
field and tensor into numpy arrays, so its time and memory grow with the model's size
(tests/bench/gguf_bench.py measures both): too much for a proxy. This reads the
key/value section alone, keeping scalars and short arrays and skipping long ones (the
tokenizer's vocabulary) without building them; it is tested against the ``gguf`` package.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

MAGIC = b"GGUF"
#: Arrays longer than this are skipped (vocabularies, merges): no shape field is one.
MAX_KEPT_ARRAY = 4096
#: Most key/value pairs and longest string accepted: a corrupt header fails, fast.
MAX_KV = 1 << 16
MAX_STRING = 1 << 20

# GGUF value types -> struct format of one scalar
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """Not a GGUF file, or a header this reader does not understand."""


class _Reader:
    def __init__(self, f: BinaryIO, order: str) -> None:
        self.f = f
        self.order = order

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise GGUFError("truncated GGUF header")
        return data

    def scalar(self, code: int) -> Any:
        fmt = self.order + _SCALARS[code]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self, keep: bool = True) -> str | None:
        n = self.scalar(10)
        if n > MAX_STRING:
            raise GGUFError(f"GGUF string of {n} bytes")
        if not keep:
            self.f.seek(n, 1)
            return None
        return self.take(n).decode("utf-8", "replace")

    def value(self, code: int) -> Any:
        if code in _SCALARS:
            return self.scalar(code)
        if code == _STRING:
            return self.string()
        if code == _ARRAY:
            item, count = self.scalar(4), self.scalar(10)
            keep = count <= MAX_KEPT_ARRAY
            if item in _SCALARS:
                size = struct.calcsize(_SCALARS[item])
                if not keep:
                    self.f.seek(size * count, 1)
                    return None
                fmt = f"{self.order}{count}{_SCALARS[item]}"
                return list(struct.unpack(fmt, self.take(size * count)))
            if item == _STRING:
                out = [self.string(keep) for _ in range(count)]
                return out if keep else None
            if item == _ARRAY:  # nested arrays: read through, never kept
                for _ in range(count):
                    self.value(_ARRAY)
                return None
        raise GGUFError(f"unknown GGUF value type {code}")


def read_metadata(path: str) -> dict[str, Any]:
    """The key/value metadata of the GGUF file at `path` (long arrays as None).

    Raises OSError when the file cannot be read, GGUFError when it is not GGUF."""
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFError(f"{path} is not a GGUF file")
        raw = f.read(4)
        if len(raw) != 4:
            raise GGUFError("truncated GGUF header")
        order = "<"
        version = struct.unpack("<I", raw)[0]
        if version & 0xFFFF == 0 and version:  # written on a big-endian machine
            order, version = ">", struct.unpack(">I", raw)[0]
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported")
        r = _Reader(f, order)
        r.scalar(10)  # tensor count
        n_kv = r.scalar(10)
        if n_kv > MAX_KV:
            raise GGUFError(f"GGUF header claims {n_kv} keys")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            assert key is not None
            meta[key] = r.value(r.scalar(4))
        return meta
