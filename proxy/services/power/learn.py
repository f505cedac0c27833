"""What a GPU's power source can resolve, learnt by watching it: which fields it has, how
often each really changes, and from that the shortest phase phasewatch measures.

A driver's fields refresh on their own clock, whatever the polling rate: polling faster
than that reads the same value again. Each field's refresh period is the median time
between the polls at which its value changed; the sampler polls fast for its first second
(:data:`PROBE_SECONDS`) so the period is known before any request is measured, and keeps
learning afterwards (a dcgm-exporter restarted with another interval).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

#: How long the sampler polls fast at start (s).
PROBE_SECONDS = 1.0
#: The fastest the sampler polls (s): during the probe, and for a fast sensor.
FASTEST_POLL = 0.01
#: A phase is measured when it lasts this many resolutions (s): shorter, the sensor's
#: refresh edges hold too large a share of it.
PHASES_PER_RESOLUTION = 2.5
#: Preferred field for phase energy, best first.
PREFERENCE = ("energy_counter", "power_instant", "power_usage", "power_average")
#: A power-usage field is assumed to be a 1 s mean (Ampere and later) unless the source
#: also has an instant field it matches.
USAGE_MEAN_SECONDS = 1.0


@dataclass
class FieldWatch:
    """One field of one GPU: its last value and the times between its changes."""

    value: float | None = None
    changed_at: float | None = None
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=15))

    def see(self, t: float, prev_t: float | None, value: float) -> bool:
        """A reading at `t` (the previous poll at `prev_t`); True when the value changed."""
        if self.value is None:
            self.value = value
            return False
        if value == self.value:
            return False
        self.value = value
        at = t if prev_t is None else (t + prev_t) / 2.0  # it changed between the polls
        if self.changed_at is not None:
            self.gaps.append(at - self.changed_at)
        self.changed_at = at
        return True

    def period(self) -> float | None:
        return statistics.median(self.gaps) if len(self.gaps) >= 2 else None


class SensorWatch:
    """Everything learnt about one GPU's fields."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.fields: dict[str, FieldWatch] = {}
        self.prev_t: float | None = None
        self.first_t: float | None = None

    def see(self, t: float, fields: dict[str, float]) -> set[str]:
        """Record one poll; the names of the fields that changed."""
        if self.first_t is None:
            self.first_t = t
        changed = {
            name
            for name, value in fields.items()
            if self.fields.setdefault(name, FieldWatch()).see(t, self.prev_t, value)
        }
        self.prev_t = t
        return changed

    def preferred(self) -> str:
        return next((f for f in PREFERENCE if f in self.fields), "power_usage")

    def refresh(self, name: str) -> float | None:
        w = self.fields.get(name)
        return None if w is None else w.period()

    def silent_for(self, name: str, now: float) -> float:
        """How long the field has gone unchanged since it was first seen (s)."""
        w = self.fields.get(name)
        if w is None or self.first_t is None:
            return 0.0
        return now - (w.changed_at if w.changed_at is not None else self.first_t)

    def resolution(self, poll: float, now: float) -> float | None:
        """The sensor's time resolution for phase energy (s): the preferred field's refresh
        period (a 1 s mean usage field: a second more), never below two polls; None until
        known. A field silent for longer than twice its period (an exporter slowed down),
        or that has changed at most once so far, is as slow as its silence says. A DCGM page
        adds its collection lag (up to a period, unknown within it)."""
        name = self.preferred()
        w = self.fields.get(name)
        if w is None or self.first_t is None:
            return None
        period = w.period()
        silent = self.silent_for(name, now)
        if period is None:
            if now - self.first_t < PROBE_SECONDS:
                return None
            period = max(silent, (now - self.first_t) / (1 + len(w.gaps)))
        elif silent > max(2.0 * period, PROBE_SECONDS):
            period = silent
        res = max(period, 2.0 * poll)
        if self.source == "dcgm" and period > 1.5 * poll:
            # the exporter's lag, corrected by half a period on average (a page that
            # changes at every poll is read as it is)
            res += 2.0 * period
        if name in ("power_usage", "power_average"):
            res += USAGE_MEAN_SECONDS
        return res

    def age(self, name: str, poll: float) -> float | None:
        """How far back a reading of field `name` may describe (s): a refresh period (a
        reading holds until the next refresh), a DCGM page's collection lag on top, and a
        1 s mean field's window; never below two polls. None while no period is known. A
        sample is classified by a state only once the state has held this long: before,
        it may show the power of the state before. The period is the fastest field's: a
        field that changes only when the power does (a noiseless sensor) looks slower
        than it refreshes."""
        known = [p for f in self.fields.values() if (p := f.period()) is not None]
        if name not in self.fields or not known:
            return None
        period = min(known)
        age = max(period, 2.0 * poll)
        if self.source == "dcgm" and period > 1.5 * poll:
            age += 2.0 * period
        if name in ("power_usage", "power_average"):
            age += USAGE_MEAN_SECONDS
        return age

    def min_phase(self, poll: float, now: float) -> float | None:
        res = self.resolution(poll, now)
        return None if res is None else PHASES_PER_RESOLUTION * res
