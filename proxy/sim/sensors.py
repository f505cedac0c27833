"""The simulated GPUs' power sensors: what NVML and a dcgm-exporter would report about the
simulator's true power, per sensor generation (docs/gpu-power.md says what each models).

The true power of a simulated GPU is a step function the engine integrates exactly
(:class:`PowerTrace`). A :class:`SensorProfile` turns it into the fields a driver serves:

- ``ideal``: every field is the true power of this instant, the counter the true energy;
- ``instant``: the power usage is instant (a short window refreshed periodically), the
  energy counter refreshes quickly, there is no 1 s mean;
- ``ampere``: the power usage is the mean over the last second, the instant field a short
  window refreshed every 100 ms, the energy counter refreshed every 100 ms.

A dcgm-exporter adds its own collection interval: its page shows the fields as they were at
its last collection (:class:`DcgmExporter`), and its default counters file has no instant
field.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

#: How far back the trace is kept (s): a 30 s exporter interval plus the 1 s mean.
TRACE_SECONDS = 45.0


class PowerTrace:
    """A GPU's true power as a step function of the monotonic clock, with its integral.

    The engine calls :meth:`segment` whenever it integrates: `watts` was drawn from the
    previous call until `now`. Readers ask :meth:`energy_at` any time back to
    :data:`TRACE_SECONDS` ago.
    """

    def __init__(self, start: float, watts: float) -> None:
        self.lock = threading.Lock()
        self.t: deque[float] = deque([start])  # segment starts
        self.e: deque[float] = deque([0.0])  # energy at each start (J)
        self.w: deque[float] = deque([watts])  # power from each start
        self.last_t = start  # integrated up to here
        self.last_e = 0.0

    def segment(self, now: float, watts: float) -> float:
        """`watts` drawn from the last call to `now`; returns the joules added."""
        with self.lock:
            if now <= self.last_t:
                return 0.0
            if watts != self.w[-1]:
                self.t.append(self.last_t)
                self.e.append(self.last_e)
                self.w.append(watts)
            joules = watts * (now - self.last_t)
            self.last_t, self.last_e = now, self.last_e + joules
            while len(self.t) > 2 and self.t[1] < now - TRACE_SECONDS:
                self.t.popleft()
                self.e.popleft()
                self.w.popleft()
            return joules

    def energy_at(self, t: float, current_watts: float) -> float:
        """True energy (J) from the trace's start to `t` (`current_watts` beyond the last
        integration)."""
        with self.lock:
            if t >= self.last_t:
                return self.last_e + current_watts * (t - self.last_t)
            i = max(0, bisect.bisect_right(self.t, t) - 1)
            return self.e[i] + self.w[i] * max(0.0, t - self.t[i])

    def steps(self, a: float, b: float, current_watts: float) -> list[list[float]]:
        """[[t, watts], ...]: the power from `a` (first entry) to `b`, each change."""
        with self.lock:
            i = max(0, bisect.bisect_right(self.t, a) - 1)
            out = [[a, self.w[i]]]
            out += [[t, w] for t, w in zip(list(self.t)[i + 1 :], list(self.w)[i + 1 :]) if t < b]
            if self.last_t < b and current_watts != out[-1][1]:
                out.append([self.last_t, current_watts])
            return out


@dataclass(frozen=True, slots=True)
class SensorProfile:
    """How one generation's driver reports power. Periods 0: continuous."""

    name: str
    usage: str  # what nvmlDeviceGetPowerUsage / DCGM_FI_DEV_POWER_USAGE is: instant | mean1s
    instant_window: float  # s averaged by the instant field (0: the true instant)
    instant_period: float  # s between refreshes of the instant field
    mean_period: float  # s between refreshes of the 1 s mean (None field when has_mean False)
    counter_period: float  # s between refreshes of the energy counter
    has_mean: bool  # NVML_FI_DEV_POWER_AVERAGE is supported
    noise: float  # relative wobble of the power fields (a real sensor's is never flat)


PROFILES = {
    "ideal": SensorProfile("ideal", "instant", 0.0, 0.0, 0.0, 0.0, True, 0.0),
    "instant": SensorProfile("instant", "instant", 0.025, 0.1, 0.0, 0.01, False, 0.004),
    "ampere": SensorProfile("ampere", "mean1s", 0.025, 0.1, 0.1, 0.1, True, 0.004),
}


def _grid(t: float, period: float, phase: float) -> float:
    """The last refresh at or before `t` of a clock ticking every `period` from `phase`."""
    if period <= 0:
        return t
    return math.floor((t - phase) / period) * period + phase


def _wobble(k: float, amount: float) -> float:
    if not amount:
        return 1.0
    return 1.0 + amount * math.sin(k * 12.9898 + 78.233)


@dataclass(slots=True)
class Fields:
    """One GPU's fields at one moment (W, W, W or None, mJ)."""

    usage: float
    instant: float
    mean: float | None
    energy_mj: int


class Sensor:
    """One simulated GPU's sensor: the profile applied to its true power trace."""

    def __init__(self, profile: SensorProfile, trace: PowerTrace, power, index: int) -> None:
        self.profile = profile
        self.trace = trace
        self.power = power  # () -> the GPU's power now (beyond the trace's last step)
        # each GPU's refresh clocks start somewhere of their own
        self.phase = (index * 0.0371 + 0.013) % 0.1
        self.origin = time.monotonic()

    def _e(self, t: float) -> float:
        return self.trace.energy_at(t, self.power())

    def read(self, t: float | None = None) -> Fields:
        p = self.profile
        t = time.monotonic() if t is None else t
        if p.instant_period <= 0 and p.instant_window <= 0:
            instant = self.power() if t >= self.trace.last_t else self._mean(t - 1e-6, t)
        else:
            tk = _grid(t, p.instant_period, self.phase)
            instant = self._mean(tk - p.instant_window, tk) * _wobble(
                round((tk - self.origin) / max(p.instant_period, 1e-3)), p.noise
            )
        mean = None
        if p.has_mean:
            tk = _grid(t, p.mean_period, self.phase)
            mean = (
                instant
                if p.usage == "instant" and p.mean_period <= 0
                else self._mean(tk - 1.0, tk)
                * _wobble(round((tk - self.origin) / max(p.mean_period, 1e-3)) + 0.5, p.noise)
            )
        usage = instant if p.usage == "instant" else (mean if mean is not None else instant)
        energy = self._e(_grid(t, p.counter_period, self.phase))
        return Fields(usage, instant, mean, int(energy * 1000.0))

    def _mean(self, a: float, b: float) -> float:
        a = max(a, self.trace.t[0])
        if b <= a:
            return self.power()
        return (self._e(b) - self._e(a)) / (b - a)


class DcgmExporter:
    """A dcgm-exporter's view: every `interval` s it collects each GPU's fields; between
    collections its page repeats the last ones. ``interval`` 0 collects on every scrape."""

    def __init__(self, interval: float, instant_field: bool) -> None:
        self.interval = interval
        self.instant_field = instant_field
        self.phase = 0.0417 if interval <= 0 else (0.0417 % interval)
        self._seen: dict[int, tuple[float, Fields]] = {}

    def fields(self, index: int, sensor: Sensor, now: float | None = None) -> Fields:
        now = time.monotonic() if now is None else now
        at = _grid(now, self.interval, self.phase)
        got = self._seen.get(index)
        if got is None or got[0] != at:
            # a collection that happened before the GPU's trace began reads its first state
            got = (at, sensor.read(max(at, sensor.trace.t[0])))
            self._seen[index] = got
        return got[1]
