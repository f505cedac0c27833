"""Power ticks and in-flight snapshots shared by the worker processes of one host.

Under ``--workers N`` one process (the primary) samples the GPUs, but every worker's
requests need their phase energy, and the sampler must know what *all* workers have in
flight at each tick. Two small memory-mapped files in the workers' private folder carry
that:

- :class:`SharedRings`: the ticks, one ring per GPU (time, energy, in-flight counts, the
  engine's own count of what it runs, each worker's snapshot number), written by the
  sampler, read by every worker to settle its requests behind the ring's horizon
  (:mod:`.ledger`). One writer per ring; a reader takes
  the write counter first and reads records behind it.
- :class:`SharedInFlight`: one row per worker with its latest snapshot number and its
  in-flight counts per GPU (prefill, decode), rewritten by each worker every few ms,
  read by the sampler at each tick. A row not rewritten for a while (a dead worker) no
  longer counts.

Both use ``time.monotonic()``, which is one clock for every process of the host.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time

from .ledger import RING_SECONDS, TickRing

MAX_GPUS = 64
_NAME = 48  # bytes of a GPU's id
_MAGIC = b"PWPOWER3"
#: Ticks kept per GPU: the ring's time at the sampler's fastest steady poll.
CAPACITY = int(RING_SECONDS / 0.02) + 1
# header: magic, capacity per ring, workers, GPUs in use; then per GPU: id, write counter,
# horizon, shortest measured phase (NaN: not known)
_HEAD = struct.Struct("<8siii")
_SLOT = struct.Struct(f"<{_NAME}sqdd")


def _file(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class SharedStore:
    """One GPU's ticks in the shared file, with :class:`~.ledger.ListStore`'s interface."""

    def __init__(self, owner: SharedRings, slot: int) -> None:
        self.owner = owner
        self.slot = slot
        self.fmt = owner.rec_struct
        self.base = owner.data_offset + slot * CAPACITY * self.fmt.size
        self.at = _HEAD.size + slot * _SLOT.size

    def _field(self, k: int) -> float:
        return _SLOT.unpack_from(self.owner.mm, self.at)[k]

    def _set(self, fmt: str, offset: int, value: float) -> None:
        struct.pack_into(fmt, self.owner.mm, self.at + offset, value)

    def count(self) -> int:
        return int(self._field(1))

    def span(self) -> tuple[int, int]:
        n = self.count()
        return max(0, n - CAPACITY + 1), n  # the oldest may be being overwritten

    def _rec(self, i: int) -> tuple:
        return self.fmt.unpack_from(self.owner.mm, self.base + (i % CAPACITY) * self.fmt.size)

    def t(self, i: int) -> float:
        return self._rec(i)[0]

    def e(self, i: int) -> float:
        return self._rec(i)[1]

    def rec(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        r = self._rec(i)
        return r[2], r[3], r[4], tuple(r[5:])

    def set_engine(self, i: int, n_engine: int) -> None:
        off = self.base + (i % CAPACITY) * self.fmt.size + 24  # after t, e, the counts
        struct.pack_into("<i", self.owner.mm, off, n_engine)

    def add_e(self, i: int, joules: float) -> None:
        off = self.base + (i % CAPACITY) * self.fmt.size + 8
        struct.pack_into("<d", self.owner.mm, off, self.e(i) + joules)

    def append(
        self, t: float, n_prefill: int, n_decode: int, n_engine: int, seqs: tuple[int, ...]
    ) -> None:
        n = self.count()
        w = self.owner.workers
        padded = (tuple(seqs) + (0,) * w)[:w]
        self.fmt.pack_into(
            self.owner.mm,
            self.base + (n % CAPACITY) * self.fmt.size,
            t,
            0.0,
            n_prefill,
            n_decode,
            n_engine,
            *padded,
        )
        self._set("<q", _NAME, n + 1)  # published once the record is in place

    @property
    def horizon(self) -> float:
        return self._field(2)

    @horizon.setter
    def horizon(self, value: float) -> None:
        self._set("<d", _NAME + 8, value)

    @property
    def min_phase(self) -> float | None:
        v = self._field(3)
        return None if math.isnan(v) else v

    @min_phase.setter
    def min_phase(self, value: float | None) -> None:
        self._set("<d", _NAME + 16, math.nan if value is None else value)


class SharedRings:
    """Every GPU's ring in one file: ``rings[gpu]`` (the sampler adds GPUs as it sees them)."""

    def __init__(self, path: str, workers: int) -> None:
        self.workers = workers
        self.rec_struct = struct.Struct(f"<ddiii{workers}q")
        self.data_offset = _HEAD.size + MAX_GPUS * _SLOT.size
        self.mm = _file(path, self.data_offset + MAX_GPUS * CAPACITY * self.rec_struct.size)
        magic, cap, w, _ = _HEAD.unpack_from(self.mm, 0)
        if magic != _MAGIC or cap != CAPACITY or w != workers:
            _HEAD.pack_into(self.mm, 0, _MAGIC, CAPACITY, workers, 0)
        self._slots: dict[str, int] = {}
        self._rings: dict[int, TickRing] = {}

    def _used(self) -> int:
        return int(_HEAD.unpack_from(self.mm, 0)[3])

    def _name(self, slot: int) -> str:
        raw = _SLOT.unpack_from(self.mm, _HEAD.size + slot * _SLOT.size)[0]
        return bytes(raw).rstrip(b"\0").decode("utf-8", "replace")

    def _refresh(self) -> None:
        for slot in range(len(self._slots), min(self._used(), MAX_GPUS)):
            self._slots[self._name(slot)] = slot

    def slot(self, gpu: str) -> int | None:
        self._refresh()
        return self._slots.get(gpu)

    def gpus(self) -> list[str]:
        self._refresh()
        return list(self._slots)

    def _ring(self, slot: int) -> TickRing:
        ring = self._rings.get(slot)
        if ring is None:
            ring = self._rings[slot] = TickRing(SharedStore(self, slot))
        return ring

    def items(self) -> list[tuple[str, TickRing]]:
        self._refresh()
        return [(gpu, self._ring(slot)) for gpu, slot in self._slots.items()]

    def __bool__(self) -> bool:
        return self._used() > 0

    def get(self, gpu: str) -> TickRing | None:
        slot = self.slot(gpu)
        return None if slot is None else self._ring(slot)

    def setdefault(self, gpu: str, _default: object = None) -> TickRing:
        """The ring of `gpu`, added when new (by the one writer, the sampler)."""
        self._refresh()
        slot = self._slots.get(gpu)
        if slot is None:
            slot = self._used()
            if slot >= MAX_GPUS:
                raise ValueError(f"more than {MAX_GPUS} GPUs")
            _SLOT.pack_into(
                self.mm,
                _HEAD.size + slot * _SLOT.size,
                gpu.encode()[:_NAME],
                0,
                float("-inf"),
                math.nan,
            )
            _HEAD.pack_into(self.mm, 0, _MAGIC, CAPACITY, self.workers, slot + 1)
            self._slots[gpu] = slot
        return self._ring(slot)

    def close(self) -> None:
        self.mm.close()


_ROW_HEAD = struct.Struct("<dq")  # when the row was written, the worker's snapshot number
_COUNTS = struct.Struct("<ii")  # prefill, decode


class SharedInFlight:
    """Each worker's latest snapshot: its number and in-flight counts per GPU slot."""

    def __init__(self, path: str, workers: int, stale_after: float) -> None:
        self.workers = workers
        self.row = _ROW_HEAD.size + MAX_GPUS * _COUNTS.size
        self.mm = _file(path, workers * self.row)
        self.stale_after = stale_after

    def publish(self, worker: int, seq: int, counts: dict[int, tuple[int, int]]) -> None:
        """Worker `worker`'s snapshot `seq`: counts by GPU slot (others count 0). The
        number is written last, so a reader that sees it sees the counts too."""
        base = worker * self.row
        _ROW_HEAD.pack_into(self.mm, base, time.monotonic(), -1)  # being written
        for slot in range(MAX_GPUS):
            prefill, decode = counts.get(slot, (0, 0))
            _COUNTS.pack_into(self.mm, base + _ROW_HEAD.size + slot * _COUNTS.size, prefill, decode)
        _ROW_HEAD.pack_into(self.mm, base, time.monotonic(), seq)

    def read(self) -> tuple[tuple[int, ...], dict[int, tuple[int, int]]]:
        """Each worker's snapshot number, and the counts per slot summed over the workers
        that wrote recently."""
        now = time.monotonic()
        seqs = []
        totals: dict[int, list[int]] = {}
        for w in range(self.workers):
            base = w * self.row
            for _ in range(1000):  # a row being rewritten is read again
                written, seq = _ROW_HEAD.unpack_from(self.mm, base)
                row = [
                    _COUNTS.unpack_from(self.mm, base + _ROW_HEAD.size + k * _COUNTS.size)
                    for k in range(MAX_GPUS)
                ]
                if seq >= 0 and _ROW_HEAD.unpack_from(self.mm, base)[1] == seq:
                    break
            seqs.append(max(0, seq))
            if now - written > self.stale_after:
                continue
            for slot, (p, d) in enumerate(row):
                if p or d:
                    got = totals.setdefault(slot, [0, 0])
                    got[0] += p
                    got[1] += d
        return tuple(seqs), {s: (c[0], c[1]) for s, c in totals.items()}

    def close(self) -> None:
        self.mm.close()
