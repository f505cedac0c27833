"""Energy between successive readings: the counter's steps, else integrated power."""

from __future__ import annotations

#: No GPU draws more than this (W): bounds what an energy-counter jump may mean.
MAX_GPU_WATTS = 5000.0
#: Longest gap (s) bridged by integrating power between two samples; beyond it the energy
#: of the gap is unknown and not made up (an energy counter still covers it).
MAX_INTEGRATION_GAP = 30.0


class EnergyMeter:
    """Energy of one GPU between successive readings, in joules.

    Uses the counter's increase where the counter is present on both readings; across a
    decrease it tries a 32- or 64-bit wrap (when that gives a plausible increase), else
    takes it for a reset (driver reload) and integrates power for that interval.
    """

    __slots__ = ("counter", "t", "watts")

    def __init__(self) -> None:
        self.t: float | None = None
        self.watts = 0.0
        self.counter: int | None = None

    def step(self, t: float, watts: float, counter: int | None) -> float:
        joules = 0.0
        if self.t is not None and t > self.t:
            dt = t - self.t
            delta = None
            if counter is not None and self.counter is not None:
                delta = counter - self.counter
                if delta < 0:
                    delta = next(
                        (
                            m - self.counter + counter
                            for m in (1 << 32, 1 << 64)
                            if self.counter < m
                            and 0 <= m - self.counter + counter <= MAX_GPU_WATTS * 1000.0 * dt
                        ),
                        None,
                    )
            if delta is not None:
                joules = delta / 1000.0
            elif dt <= MAX_INTEGRATION_GAP:
                joules = (self.watts + watts) / 2.0 * dt
        self.t, self.watts, self.counter = t, watts, counter
        return joules
