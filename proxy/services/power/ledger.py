"""Energy by request and phase, at the sensor's resolution, conserved.

Every sampler tick records what was in flight on a GPU (a numbered *snapshot* of each
process's requests, :class:`InFlightBook`). When the sensor refreshes (its energy counter
steps, or a power reading integrated over the last tick), the energy of the interval it
covers is spread over the ticks inside it (:meth:`TickRing.distribute`), weighted by the
power each tick's state (idle / prefill / decode) was last seen to draw, so an interval that
holds a phase edge gives each side its due. A tick's energy then belongs evenly to the
requests running on the GPU at it: this host's in flight, plus the others the engine held
at its last count (its count less what this host had in flight then: requests other
replicas or direct clients sent it; :data:`NO_COUNT` where the engine gives none, and
then this host's requests are all there is). This host's requests get their shares; the
rest is *unattributed*; a tick with nothing running is idle. Attributed + unattributed +
idle add up to the counter's delta.

A request's phases are settled once the sensor has covered its end: its ticks are found by
snapshot number, so a request is charged for exactly the ticks whose in-flight count
included it.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

#: How long ticks are kept (s): a request longer than this gets no energy.
RING_SECONDS = 600.0
#: How fast a state's learnt power follows a new pure interval (0..1).
WEIGHT_GAIN = 0.3
#: A tick's engine count when the engine gives none (or it is not known yet).
NO_COUNT = -1


def running(n_prefill: int, n_decode: int, n_engine: int) -> int:
    """How many requests share a tick's energy: this host's in flight, or what the engine
    ran when that is more (others' requests beside ours)."""
    return max(n_prefill + n_decode, n_engine)


def phase_of(ex: Any) -> str:
    """prefill before the first token of a streamed request, else decode (a non-streamed
    request shows no first token and spends most of its time decoding)."""
    return "prefill" if ex.marks.t_first is None and ex.prepared.stream else "decode"


@dataclass(eq=False)
class Entry:
    """One request as the snapshots saw it."""

    ex: Any
    gpus: tuple[str, ...]
    first_seq: int
    t_seen: float
    decode_seq: int | None = None
    end_seq: int | None = None
    ended: float | None = None  # when the snapshots first missed it
    completion_tokens: int | None = None
    recorded: bool = False  # the recorder has finished it (its figures are final)
    #: phases already counted unresolved (too short for the sensor, known before the
    #: sensor covers the request)
    decided: set[str] = field(default_factory=set)


class InFlightBook:
    """This process's requests in flight on each GPU, as numbered snapshots.

    :meth:`snapshot` (the sampler's thread, or a worker's publisher) compares what is in
    flight now with the last snapshot; any change makes a new number. Each request keeps
    the numbers at which it appeared, moved to decode, and left.
    """

    def __init__(self, in_flight) -> None:
        self.in_flight = in_flight  # gpu -> this process's exchanges on it
        self.lock = threading.Lock()
        self.seq = 0
        self.live: dict[Any, tuple[str, tuple[str, ...]]] = {}  # ex -> (phase, gpus)
        self.entries: dict[Any, Entry] = {}

    def snapshot(self, gpus: list[str], now: float) -> tuple[int, dict[str, tuple[int, int]]]:
        cur: dict[Any, tuple[str, list[str]]] = {}
        for gpu in gpus:
            for ex in self.in_flight(gpu):
                got = cur.get(ex)
                if got is None:
                    cur[ex] = (phase_of(ex), [gpu])
                else:
                    got[1].append(gpu)
        with self.lock:
            now_live = {ex: (ph, tuple(g)) for ex, (ph, g) in cur.items()}
            if now_live != self.live:
                self.seq += 1
                for ex, (ph, g) in now_live.items():
                    e = self.entries.get(ex)
                    if e is None or e.end_seq is not None:
                        e = self.entries[ex] = Entry(ex, g, self.seq, now)
                    if ph == "decode" and e.decode_seq is None:
                        e.decode_seq = self.seq
                for ex in self.live.keys() - now_live.keys():
                    e = self.entries.get(ex)
                    if e is not None and e.end_seq is None:
                        e.end_seq, e.ended = self.seq, now
                self.live = now_live
            counts: dict[str, list[int]] = {g: [0, 0] for g in gpus}
            for ph, g in now_live.values():
                for gpu in g:
                    counts[gpu][0 if ph == "prefill" else 1] += 1
            return self.seq, {g: (c[0], c[1]) for g, c in counts.items()}

    def recorded(self, ex: Any, completion_tokens: int | None) -> Entry | None:
        """The recorder finished `ex`; its entry when a snapshot saw it."""
        with self.lock:
            e = self.entries.get(ex)
            if e is not None:
                e.recorded, e.completion_tokens = True, completion_tokens
            return e

    def ended(self, now: float, forget_after: float) -> list[Entry]:
        """The finished requests the recorder has seen; one it never saw (no listener
        ran for it) is forgotten after `forget_after` s, so nothing piles up."""
        with self.lock:
            for ex, e in list(self.entries.items()):
                if not e.recorded and e.ended is not None and now - e.ended > forget_after:
                    del self.entries[ex]
            return [e for e in self.entries.values() if e.end_seq is not None and e.recorded]

    def drop(self, e: Entry) -> None:
        with self.lock:
            if self.entries.get(e.ex) is e:
                del self.entries[e.ex]


@dataclass
class PhaseSum:
    joules: float = 0.0  # the GPU's energy over the phase's ticks
    share: float = 0.0  # the request's share of it
    seconds: float = 0.0  # the ticks' length


class ListStore:
    """Ticks in this process's memory (the sampler and the requests in one process)."""

    def __init__(self, keep_seconds: float = RING_SECONDS) -> None:
        self.keep = keep_seconds
        self.base = 0  # absolute index of the first kept tick
        self.ts: list[float] = []
        self.recs: list[tuple[int, int, int, tuple[int, ...]]] = []
        self.es: list[float] = []
        self.horizon = float("-inf")
        self.min_phase: float | None = None

    def span(self) -> tuple[int, int]:
        return self.base, self.base + len(self.ts)

    def t(self, i: int) -> float:
        return self.ts[i - self.base]

    def rec(self, i: int) -> tuple[int, int, int, tuple[int, ...]]:
        return self.recs[i - self.base]

    def e(self, i: int) -> float:
        return self.es[i - self.base]

    def add_e(self, i: int, joules: float) -> None:
        self.es[i - self.base] += joules

    def set_engine(self, i: int, n_engine: int) -> None:
        n_prefill, n_decode, _, seqs = self.recs[i - self.base]
        self.recs[i - self.base] = (n_prefill, n_decode, n_engine, seqs)

    def append(
        self, t: float, n_prefill: int, n_decode: int, n_engine: int, seqs: tuple[int, ...]
    ) -> None:
        self.ts.append(t)
        self.recs.append((n_prefill, n_decode, n_engine, seqs))
        self.es.append(0.0)
        if len(self.ts) % 1024 == 0 and self.ts[0] < t - self.keep:
            k = bisect.bisect_left(self.ts, min(t - self.keep, self.horizon))
            del self.ts[:k], self.recs[:k], self.es[:k]
            self.base += k


class TickRing:
    """One GPU's ticks (start time, in-flight counts, the engine's count, snapshot
    numbers, energy so far) over a store: this process's lists, or (``--workers N``) the
    workers' shared file. One writer (the sampler); readers settle requests behind its
    horizon."""

    def __init__(self, store: Any = None) -> None:
        self.store = store if store is not None else ListStore()
        self.lock = threading.Lock()
        self.weights: dict[str, float] = {}  # state -> learnt watts (the writer's)
        #: joules spread on ticks and owed to requests this host did not relay, not yet
        #: taken by the writer (:meth:`take_unattributed`)
        self._unattributed = 0.0

    def append(
        self,
        t: float,
        n_prefill: int,
        n_decode: int,
        seqs: tuple[int, ...],
        n_engine: int = NO_COUNT,
    ) -> None:
        with self.lock:
            self.store.append(t, n_prefill, n_decode, n_engine, seqs)

    def recount(self, since: float, others: int) -> None:
        """Ticks from `since` on that hold no energy yet: the engine ran `others`
        requests besides this host's (a count read after they were appended)."""
        st = self.store
        with self.lock:
            first, end = st.span()
            i = end - 1
            while i >= first and st.t(i) >= since and st.t(i) >= st.horizon:
                n_prefill, n_decode, _, _ = st.rec(i)
                st.set_engine(i, n_prefill + n_decode + others)
                i -= 1

    def take_unattributed(self) -> float:
        """The unattributed joules spread since the last call (the writer's)."""
        with self.lock:
            got, self._unattributed = self._unattributed, 0.0
            return got

    @property
    def min_phase(self) -> float | None:
        return self.store.min_phase

    @min_phase.setter
    def min_phase(self, value: float | None) -> None:
        self.store.min_phase = value

    def _first_after(self, t: float) -> int:
        """The first tick starting after `t`."""
        lo, hi = self.store.span()
        while lo < hi:
            mid = (lo + hi) // 2
            if self.store.t(mid) <= t:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _state(self, i: int) -> str:
        """What tick `i` drew for: prefill when one of this host's requests was before its
        first token; decode when others ran (their phase is not known) or ours decoded."""
        n_prefill, n_decode, n_engine, _ = self.store.rec(i)
        return "prefill" if n_prefill else "decode" if n_decode or n_engine > 0 else "idle"

    def distribute(self, a: float, b: float, joules: float) -> float:
        """Spread `joules` drawn over [a, b] on the ticks it overlaps; the idle part (the
        part owed to others' requests is kept for :meth:`take_unattributed`)."""
        st = self.store
        with self.lock:
            first, end = st.span()
            if first == end or b <= a:
                return 0.0
            parts: list[tuple[int, float, str]] = []
            for i in range(max(first, self._first_after(a) - 1), end):
                start = st.t(i)
                if start >= b:
                    break
                stop = st.t(i + 1) if i + 1 < end else b
                overlap = min(stop, b) - max(start, a)
                if overlap > 0:
                    parts.append((i, overlap, self._state(i)))
            if not parts:  # the interval lies before the first tick: the first takes it
                parts = [(first, 1.0, self._state(first))]
            states = {s for _, _, s in parts}
            weights = self._weights(parts, joules)
            w = [ov * weights.get(s, 1.0) for _, ov, s in parts]
            if sum(w) <= 0:  # every state here weighs nothing: by time alone
                w = [ov for _, ov, _ in parts]
            total = sum(w) or 1.0
            idle = 0.0
            for (i, _, s), wi in zip(parts, w):
                share = joules * wi / total
                st.add_e(i, share)
                if s == "idle":
                    idle += share
                else:
                    n_prefill, n_decode, n_engine, _ = st.rec(i)
                    n = running(n_prefill, n_decode, n_engine)
                    self._unattributed += share * (n - n_prefill - n_decode) / n
            if len(states) == 1:  # a pure interval: what this state draws
                s = states.pop()
                watts = joules / (b - a)
                old = self.weights.get(s)
                self.weights[s] = watts if old is None else old + WEIGHT_GAIN * (watts - old)
            st.horizon = max(st.horizon, b)
            return idle

    def _weights(self, parts: list[tuple[int, float, str]], joules: float) -> dict[str, float]:
        """Each state's power for this interval: the learnt ones; a single state not
        learnt yet gets what the interval's energy leaves it when it holds enough of the
        interval (and is learnt from that); else every state weighs the same."""
        time_in: dict[str, float] = {}
        for _, ov, s in parts:
            time_in[s] = time_in.get(s, 0.0) + ov
        unknown = [s for s in time_in if s not in self.weights]
        if not unknown:
            return self.weights
        total = sum(time_in.values())
        if len(unknown) == 1 and len(time_in) > 1 and time_in[unknown[0]] >= 0.3 * total:
            u = unknown[0]
            rest = sum(self.weights[s] * t for s, t in time_in.items() if s != u)
            watts = max(0.0, joules - rest) / time_in[u]
            self.weights[u] = watts
            return self.weights
        return {}

    def settle(self, worker: int, e: Entry) -> dict[str, PhaseSum] | None:
        """The request's phases once the energy of all its ticks is final (None before)."""
        st = self.store
        assert e.end_seq is not None
        with self.lock:
            first, end = st.span()
            out = {"prefill": PhaseSum(), "decode": PhaseSum()}
            i = max(first, self._first_after(e.t_seen) - 1)
            while i < end:
                n_prefill, n_decode, n_engine, seqs = st.rec(i)
                s = seqs[worker] if worker < len(seqs) else 0
                if s >= e.end_seq:
                    return out if st.t(i) <= st.horizon else None
                if s >= e.first_seq:
                    ph = "prefill" if e.decode_seq is None or s < e.decode_seq else "decode"
                    if i + 1 >= end:
                        return None
                    p = out[ph]
                    p.joules += st.e(i)
                    p.share += st.e(i) / max(1, running(n_prefill, n_decode, n_engine))
                    p.seconds += st.t(i + 1) - st.t(i)
                i += 1
            return None
