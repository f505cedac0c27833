"""The figures of a scenario's runs: median, min and max, their spread, and how the
bench writes them (shared by the bench and :mod:`.compare`)."""

from __future__ import annotations

import statistics


def stats(values) -> dict | None:
    """Median, min and max of a scenario's runs (None when no run gave a figure)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
    }


def spread(st: dict | None) -> float | None:
    """The runs' range relative to their median: (max - min) / median."""
    if not st or st["n"] < 2 or not st["median"]:
        return None
    return (st["max"] - st["min"]) / abs(st["median"])


def num(v: float) -> str:
    """A figure with about three significant digits."""
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def cell(st: dict | None, fmt: str = "{:.1f}", unit: str = "", none: str = "—") -> str:
    """median (min–max): every figure with the spread of its runs."""
    if not st:
        return none
    med = fmt.format(st["median"]) + unit
    if st["n"] < 2:
        return med
    return f"{med} ({num(st['min'])}–{num(st['max'])})"


def size_label(tokens: int) -> str:
    return f"~{round(tokens / 1024)}K" if tokens >= 1024 else f"{tokens} tok"


def legacy_stats(value, runs=None) -> dict | None:
    """Stats for a figure of a result written before they were kept (--compare)."""
    if runs:
        return stats(runs)
    return None if value is None else {"median": value, "min": value, "max": value, "n": 1}
