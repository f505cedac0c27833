"""What a GPU's sensor may say: a reading no GPU can produce is refused before it reaches
any figure (energy, the current power, the samples), counted by reason in
``phasewatch_gpu_sensor_rejected_total`` and logged once per reason.

A power field is refused when it is not finite, negative, or above the GPU's cap: twice its
power limit where the source reports a believable one, else ``--power-max-watts``. One
impossible field makes the whole reading suspect: the GPU's tick is skipped.

The energy counter is judged by its steps. A step is accepted while the energy it adds
keeps the counter within the cap over the time since its last step, with
:data:`BURST_SECONDS` of slack (a leaky bucket, so the slack is never a lasting excess: a
long-run rate above the cap is impossible). A counter that goes backwards, or jumps by more
than the GPU could draw, is refused; a refused value is remembered as a candidate, and the
counter is trusted again either when it comes back to where it was (a jitter: neither the
jump nor the jump back counts) or when it goes on from the candidate by a plausible step (a
genuine reset such as a driver reload, or a counter that really moved: counted from the new
level, the jump itself never). Readings the counter is not trusted for are passed on
without it, so that stretch is integrated from power instead. The first value after start
is passed on as the counter's base (it adds no energy; the sampler counts from its first
step).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from ...measure.metrics import Metrics
from .sources import Reading

log = logging.getLogger(__name__)

#: A reading above this multiple of the GPU's power limit is refused.
LIMIT_FACTOR = 2.0
#: A power limit below this (W) is not believed (no datacenter GPU's; believing a lying
#: one would refuse every honest reading): the cap is then --power-max-watts.
MIN_LIMIT_WATTS = 50.0
#: Seconds at the cap an energy counter may run ahead of the time since its last step:
#: the jitter in when a page's fields were collected, never a lasting excess.
BURST_SECONDS = 1.0
#: Wraps a counter may make: a 32- and a 64-bit register.
WRAPS = (1 << 32, 1 << 64)
#: Why a reading is refused (the ``reason`` label).
REASONS = (
    "not_finite",  # NaN or ±Inf
    "negative",
    "too_high",  # above the cap
    "counter_backwards",  # the energy counter went down (not a wrap)
    "counter_jump",  # a counter step implying more power than the cap
    "page_too_large",  # a DCGM page over --power-dcgm-max-bytes (gpu "all")
)


def bad_watts(value: float, cap: float) -> str | None:
    """Why a power reading (W) is impossible, or None."""
    if not math.isfinite(value):
        return "not_finite"
    if value < 0:
        return "negative"
    if value > cap:
        return "too_high"
    return None


@dataclass(slots=True)
class CounterGuard:
    """One GPU's energy counter: the last trusted value, and the slack used up."""

    base: int | None = None  # the last accepted value (mJ)
    at: float = 0.0  # when it was first seen
    level: float = 0.0  # joules run ahead of cap x time (the bucket)
    trusted: bool = False  # counted from: the first value, or a plausible step since a refusal
    candidate: int | None = None  # the last refused value
    candidate_at: float = 0.0

    def _fits(self, prev: int, prev_at: float, value: int, t: float, cap: float):
        """(level after the step, None) or (None, why not) for a step prev -> value."""
        delta = value - prev
        if delta < 0:
            wrapped = [m - prev + value for m in WRAPS if prev < m]
            delta = next((d for d in wrapped if self._level(d, prev_at, t, cap) is not None), -1)
            if delta < 0:
                return None, "counter_backwards"
        level = self._level(delta, prev_at, t, cap)
        return (level, None) if level is not None else (None, "counter_jump")

    def _level(self, delta_mj: int, prev_at: float, t: float, cap: float) -> float | None:
        level = max(0.0, self.level + delta_mj / 1000.0 - cap * max(0.0, t - prev_at))
        return level if level <= cap * BURST_SECONDS else None

    def see(self, value: float | None, t: float, cap: float) -> tuple[int | None, str | None]:
        """(the value to count from, or None; why it was refused, or None). A refusal
        is reported once per refused value, and only while the counter is trusted (a
        value passed on after None starts the meter's count: :class:`.EnergyMeter`
        integrates power over that interval, never a step across a refusal)."""
        if value is None:
            return None, None
        why = bad_watts(value, math.inf)
        if why is not None:
            return None, why
        c = int(value)
        if self.base is None:  # the base: a step from it is judged next
            self.base, self.at, self.trusted = c, t, True
            return c, None
        if c == self.base:
            self.candidate = None  # back where it was: a jitter
            return (c if self.trusted else None), None
        level, why = self._fits(self.base, self.at, c, t, cap)
        if level is not None:
            self.base, self.at, self.level, self.trusted, self.candidate = c, t, level, True, None
            return c, None
        if self.candidate is not None and c != self.candidate:
            level, _ = self._fits(self.candidate, self.candidate_at, c, t, cap)
            if level is not None:  # it goes on from the refused value: counted from here
                self.base, self.at, self.level, self.candidate = c, t, level, None
                was, self.trusted = self.trusted, True
                return c, ("rebased" if was else None)
        if c == self.candidate:
            return None, None  # the same refused value again: refused, not counted again
        self.candidate, self.candidate_at = c, t
        return None, (why if self.trusted else None)


class SensorGuard:
    """Checks every reading before the sampler uses it (see the module's docstring)."""

    def __init__(self, max_watts: float, metrics: Metrics) -> None:
        self.max_watts = max_watts
        self.metrics = metrics
        self.counters: dict[str, CounterGuard] = {}
        self._said: set[str] = set()

    def cap(self, limit: float | None) -> float:
        """The most a GPU may draw (W): twice a believable power limit, else the flag's."""
        if limit is not None and MIN_LIMIT_WATTS <= limit <= self.max_watts:
            return LIMIT_FACTOR * limit
        return self.max_watts

    def check(self, gpu: str, r: Reading, t: float) -> Reading | None:
        """The reading with what may be used, or None when its power is impossible."""
        cap = self.cap(r.limit)
        for name, value in (
            ("power_usage", r.watts),
            ("power_instant", r.instant),
            ("power_average", r.average),
        ):
            if value is None:
                continue
            why = bad_watts(value, cap)
            if why is not None:
                self.refuse(gpu, why, f"{name} {value!r} W (cap {cap:g} W)")
                return None
        counter = self.counters.setdefault(gpu, CounterGuard())
        energy, why = counter.see(r.energy_mj, t, cap)
        if why == "rebased":
            self._once(
                "rebased",
                "GPU %r energy counter goes on from a value refused before (a reset such as a "
                "driver reload, or a jump that stayed): counted again from there, the jump "
                "itself not",
                gpu,
            )
        elif why is not None:
            self.refuse(gpu, why, f"energy counter {r.energy_mj!r} mJ (cap {cap:g} W)")
        return replace(r, energy_mj=energy)

    def refuse(self, gpu: str, reason: str, what: str) -> None:
        """Count a refused reading; the first of each reason is logged."""
        self.metrics.gpu_sensor_rejected_total.labels(gpu, reason).inc()
        self._once(
            reason,
            "GPU %r power sensor reading refused: %s (reason=%s): no GPU reports that; "
            "counted in phasewatch_gpu_sensor_rejected_total, logged once per reason",
            gpu,
            what,
            reason,
        )

    def _once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(msg, *args)
