"""Power samples and in-flight counts shared by the worker processes of one host.

Under ``--workers N`` one process (the primary) samples the GPUs, but every worker's
requests need their phase power, and the sampler must classify each sample (idle /
prefill / decode) by what *all* workers have in flight. Two small memory-mapped files in
the workers' private folder carry that:

- :class:`SharedRings`: the samples, one ring per GPU (time, watts, requests in flight),
  written by the sampler, read by every worker for its requests' windows. One writer per
  ring; a reader takes the write counter first and reads records behind it.
- :class:`SharedInFlight`: one row per worker with its in-flight counts per GPU
  (prefill, decode), rewritten by each worker every sampling interval, summed by the
  sampler. A row not rewritten for a while (a dead worker) no longer counts.

Both use ``time.monotonic()``, which is one clock for every process of the host.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterator

MAX_GPUS = 64
_NAME = 48  # bytes of a GPU's id
_MAGIC = b"PWPOWER1"
# header: magic, capacity per ring, GPUs in use; then per GPU: id, write counter
_HEAD = struct.Struct("<8sii")
_SLOT = struct.Struct(f"<{_NAME}sq")
_REC = struct.Struct("<ddd")  # t, watts, in flight


def _file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SharedRing:
    """One GPU's samples in the shared file, with :class:`~.energy.Ring`'s interface."""

    def __init__(self, owner: SharedRings, slot: int) -> None:
        self.owner = owner
        self.slot = slot
        self.base = owner.data_offset + slot * owner.capacity * _REC.size

    def _count(self) -> int:
        return self.owner.counter(self.slot)

    def append(self, t: float, watts: float, in_flight: int) -> None:
        n = self._count()
        _REC.pack_into(
            self.owner.mm,
            self.base + (n % self.owner.capacity) * _REC.size,
            t,
            watts,
            float(in_flight),
        )
        self.owner.set_counter(self.slot, n + 1)  # published once the record is in place

    def _record(self, i: int) -> tuple[float, float, float]:
        return _REC.unpack_from(self.owner.mm, self.base + (i % self.owner.capacity) * _REC.size)

    def window(self, a: float, b: float) -> tuple[list[float], list[float], list[int], int]:
        """The samples covering [a, b] (one beyond each end) and how many lie inside."""
        end = self._count()
        start = max(0, end - self.owner.capacity + 1)  # the oldest may be being overwritten
        lo, hi = self._first_at_or_after(start, end, a), self._first_after(start, end, b)
        inside = hi - lo
        recs = [self._record(i) for i in range(max(start, lo - 1), min(end, hi + 1))]
        return [r[0] for r in recs], [r[1] for r in recs], [int(r[2]) for r in recs], inside

    def _first_at_or_after(self, lo: int, hi: int, t: float) -> int:
        while lo < hi:
            mid = (lo + hi) // 2
            if self._record(mid)[0] < t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _first_after(self, lo: int, hi: int, t: float) -> int:
        while lo < hi:
            mid = (lo + hi) // 2
            if self._record(mid)[0] <= t:
                lo = mid + 1
            else:
                hi = mid
        return lo


class SharedRings:
    """Every GPU's ring in one file: ``rings[gpu]`` (the sampler adds GPUs as it sees them)."""

    def __init__(self, path: str, capacity: int) -> None:
        self.capacity = capacity
        self.data_offset = _HEAD.size + MAX_GPUS * _SLOT.size
        self.mm = _file(path, self.data_offset + MAX_GPUS * capacity * _REC.size)
        magic, cap, _ = _HEAD.unpack_from(self.mm, 0)
        if magic != _MAGIC or cap != capacity:
            _HEAD.pack_into(self.mm, 0, _MAGIC, capacity, 0)
        self._slots: dict[str, int] = {}

    def _used(self) -> int:
        return int(_HEAD.unpack_from(self.mm, 0)[2])

    def _name(self, slot: int) -> str:
        raw = _SLOT.unpack_from(self.mm, _HEAD.size + slot * _SLOT.size)[0]
        return bytes(raw).rstrip(b"\0").decode("utf-8", "replace")

    def counter(self, slot: int) -> int:
        return int(_SLOT.unpack_from(self.mm, _HEAD.size + slot * _SLOT.size)[1])

    def set_counter(self, slot: int, value: int) -> None:
        struct.pack_into("<q", self.mm, _HEAD.size + slot * _SLOT.size + _NAME, value)

    def _refresh(self) -> None:
        for slot in range(len(self._slots), min(self._used(), MAX_GPUS)):
            self._slots[self._name(slot)] = slot

    def slot(self, gpu: str) -> int | None:
        self._refresh()
        return self._slots.get(gpu)

    def gpus(self) -> list[str]:
        self._refresh()
        return list(self._slots)

    def items(self) -> Iterator[tuple[str, SharedRing]]:
        self._refresh()
        return iter([(gpu, SharedRing(self, slot)) for gpu, slot in self._slots.items()])

    def __bool__(self) -> bool:
        return self._used() > 0

    def get(self, gpu: str) -> SharedRing | None:
        slot = self.slot(gpu)
        return None if slot is None else SharedRing(self, slot)

    def setdefault(self, gpu: str, _default: object = None) -> SharedRing:
        """The ring of `gpu`, added when new (by the one writer, the sampler)."""
        self._refresh()
        slot = self._slots.get(gpu)
        if slot is None:
            slot = self._used()
            if slot >= MAX_GPUS:
                raise ValueError(f"more than {MAX_GPUS} GPUs")
            _SLOT.pack_into(self.mm, _HEAD.size + slot * _SLOT.size, gpu.encode()[:_NAME], 0)
            _HEAD.pack_into(self.mm, 0, _MAGIC, self.capacity, slot + 1)
            self._slots[gpu] = slot
        return SharedRing(self, slot)

    def close(self) -> None:
        self.mm.close()


_ROW_HEAD = struct.Struct("<d")  # when the row was written
_COUNTS = struct.Struct("<ii")  # prefill, decode


class SharedInFlight:
    """Each worker's in-flight counts per GPU slot, summed over the living workers."""

    def __init__(self, path: str, workers: int, stale_after: float) -> None:
        self.workers = workers
        self.row = _ROW_HEAD.size + MAX_GPUS * _COUNTS.size
        self.mm = _file(path, workers * self.row)
        self.stale_after = stale_after

    def publish(self, worker: int, counts: dict[int, tuple[int, int]]) -> None:
        """Worker `worker`'s counts by GPU slot; slots it does not name count 0."""
        base = worker * self.row
        for slot in range(MAX_GPUS):
            prefill, decode = counts.get(slot, (0, 0))
            _COUNTS.pack_into(self.mm, base + _ROW_HEAD.size + slot * _COUNTS.size, prefill, decode)
        _ROW_HEAD.pack_into(self.mm, base, time.monotonic())

    def counts(self, slot: int) -> tuple[int, int]:
        """(prefill, decode) on GPU slot `slot` over every worker that wrote recently."""
        now = time.monotonic()
        prefill = decode = 0
        for w in range(self.workers):
            base = w * self.row
            if now - _ROW_HEAD.unpack_from(self.mm, base)[0] > self.stale_after:
                continue
            p, d = _COUNTS.unpack_from(self.mm, base + _ROW_HEAD.size + slot * _COUNTS.size)
            prefill += p
            decode += d
        return prefill, decode

    def close(self) -> None:
        self.mm.close()
