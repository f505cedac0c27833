"""Energy per token by phase from many requests: least squares over an energy counter's
steps.

A short prefill (50-300 ms) lies inside one or two steps of a 100 ms energy counter, so no
single one can be measured; many of them, each at its own place against the steps, fix
the energy per prompt token. One GPU's steps are modelled as

    step joules = idle_W x (seconds of the step with no request in flight)
                  + sum over groups k of  jp_k x (k's prompt tokens in the step)
                                        + jd_k x (k's output tokens in the step)

where a request's prompt tokens are spread evenly over its prefill window (sent to first
token) and its output tokens after the first over its decode window (first to last
token); a group is one upstream x model x precision. Busy time has no term of its own, so
``jp`` and ``jd`` carry the board's whole draw while the phase runs (the idle share
included, as the counter reports it), and a phase's watts are its joules per token times
its tokens per second.

A step's times are the sampler's estimate of when the counter stepped; a sensor's or an
exporter's lag moves them. The fit tries shifts of the steps against the requests and
keeps the one that leaves the least residual (the lag is one unknown more, per GPU).

A figure comes with its 95 % interval (least squares' standard errors) and the
number of requests behind it; it is given only when it rests on :data:`MIN_REQUESTS`
or more and the interval is within :data:`TIGHT` of it, else it says why not. Pure: no
I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: A figure is given once its 95 % interval is within this share of it.
TIGHT = 0.10
#: The fewest requests a figure rests on: with fewer, the steps' lag and the residuals'
#: spread are fitted to a handful of edges and the interval is not to be trusted.
MIN_REQUESTS = 10
#: Two-sided 95 % quantile of the normal distribution (there are many more steps than
#: unknowns, so Student's t is the same to the second decimal).
Z95 = 1.96
#: Shifts of the steps against the requests tried (s): coarse, then refined round the best.
COARSE_SHIFTS = tuple(round(-0.2 + 0.04 * i, 3) for i in range(11))
FINE_SHIFT = 0.01
#: The fewest steps per unknown the fit needs.
STEPS_PER_UNKNOWN = 5
#: No GPU draws more than this (W): a step claiming more is a sensor's glitch, left out.
MAX_WATTS = 5000.0

GroupKey = tuple[str, str, str]  # upstream, model, precision
PHASES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Step:
    """Energy the GPU's counter reported over [a, b] (s, J)."""

    a: float
    b: float
    joules: float


@dataclass(frozen=True, slots=True)
class Work:
    """One finished request on the GPU, as the proxy saw it.

    ``first`` is None for a request whose phases the proxy cannot tell apart (not
    streamed): it keeps the steps it overlaps out of the fit. ``output_tokens`` are the
    tokens after the first (the first comes out of the prefill)."""

    key: GroupKey
    sent: float
    first: float | None
    last: float | None
    end: float
    prompt_tokens: int = 0
    output_tokens: int = 0

    def windows(self) -> list[tuple[str, float, float, int]]:
        """(phase, start, stop, tokens) of each phase that has tokens and a length."""
        out: list[tuple[str, float, float, int]] = []
        if self.first is None:
            return out
        if self.prompt_tokens > 0 and self.first > self.sent:
            out.append(("prefill", self.sent, self.first, self.prompt_tokens))
        if self.last is not None and self.output_tokens > 0 and self.last > self.first:
            out.append(("decode", self.first, self.last, self.output_tokens))
        return out


@dataclass(slots=True)
class Solution:
    """One GPU's fit: a coefficient per column (``("idle", "")`` first, then (key,
    phase)), their covariance, and what it rests on."""

    columns: list[tuple[GroupKey | str, str]]
    coef: list[float]
    cov: list[list[float]]
    rss: float
    rows: int
    shift: float
    requests: dict[tuple[GroupKey, str], int] = field(default_factory=dict)
    tokens: dict[tuple[GroupKey, str], int] = field(default_factory=dict)
    seconds: dict[tuple[GroupKey, str], float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Figure:
    """A phase's figure for one group, or why there is none."""

    joules_per_token: float | None = None
    low: float | None = None
    high: float | None = None
    watts: float | None = None
    requests: int = 0
    unresolved: str | None = None

    def as_dict(self) -> dict:
        if self.unresolved is not None:
            return {"unresolved": self.unresolved, "requests": self.requests}
        return {
            "joules_per_token": self.joules_per_token,
            "watts": self.watts,
            "low": self.low,
            "high": self.high,
            "requests": self.requests,
        }


# --- building the rows --------------------------------------------------------------------


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _spread(
    starts: list[float], ends: list[float], a: float, b: float, amount: float, into, col: int
) -> None:
    """Add `amount`, spread evenly over [a, b], to the rows of the steps it overlaps."""
    length = b - a
    i = max(0, bisect.bisect_right(starts, a) - 1)
    while i < len(starts) and starts[i] < b:
        ov = min(b, ends[i]) - max(a, starts[i])
        if ov > 0:
            row = into[i]
            row[col] = row.get(col, 0.0) + amount * ov / length
        i += 1


def _rows(steps: Sequence[Step], works: Sequence[Work], shift: float):
    """The columns, and per usable step its (row: column -> value, joules)."""
    starts = [s.a - shift for s in steps]
    ends = [s.b - shift for s in steps]
    n = len(steps)
    cols: dict[tuple[GroupKey | str, str], int] = {("idle", ""): 0}
    rows: list[dict[int, float]] = [{} for _ in range(n)]
    blocked = [False] * n
    busy = []
    for w in works:
        stop = max(w.end, w.last or w.sent)
        busy.append((w.sent, stop))
        wins = w.windows()
        if not wins:  # phases unknown: its steps say nothing about any phase
            i = max(0, bisect.bisect_right(starts, w.sent) - 1)
            while i < n and starts[i] < stop:
                if ends[i] > w.sent:
                    blocked[i] = True
                i += 1
            continue
        for phase, a, b, tokens in wins:
            col = cols.setdefault((w.key, phase), len(cols))
            _spread(starts, ends, a, b, float(tokens), rows, col)
    # idle: the step's time outside every request's [sent, end]
    busy_in = [0.0] * n
    for a, b in _merge(busy):
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < n and starts[i] < b:
            ov = min(b, ends[i]) - max(a, starts[i])
            if ov > 0:
                busy_in[i] += ov
            i += 1
    out = []
    for i, s in enumerate(steps):
        dt = s.b - s.a
        if blocked[i] or dt <= 0 or s.joules < 0 or s.joules > MAX_WATTS * dt:
            continue
        row = rows[i]
        idle = dt - busy_in[i]
        if idle > 1e-9:
            row[0] = idle
        if row:
            out.append((row, s.joules))
    return cols, out


# --- the least squares ---------------------------------------------------------------------


def _cholesky_inverse(a: list[list[float]]) -> list[list[float]] | None:
    """The inverse of a symmetric positive-definite matrix; None when it is singular."""
    p = len(a)
    low = [[0.0] * p for _ in range(p)]
    for i in range(p):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if s <= 1e-12 * max(1.0, a[i][i]):
                    return None
                low[i][i] = math.sqrt(s)
            else:
                low[i][j] = s / low[j][j]
    # invert the lower factor, then inv(A) = inv(L)^T inv(L)
    inv_l = [[0.0] * p for _ in range(p)]
    for i in range(p):
        inv_l[i][i] = 1.0 / low[i][i]
        for j in range(i):
            s = -sum(low[i][k] * inv_l[k][j] for k in range(j, i))
            inv_l[i][j] = s / low[i][i]
    return [
        [sum(inv_l[k][i] * inv_l[k][j] for k in range(max(i, j), p)) for j in range(p)]
        for i in range(p)
    ]


def solve(
    rows: Sequence[tuple[dict[int, float], float]],
    p: int,
    weights: Sequence[float] | None = None,
) -> tuple[list[float], list[list[float]], float] | None:
    """(Weighted) least squares over sparse rows: (coefficients, covariance, weighted
    residual sum of squares), None when the columns do not determine them. Columns are
    scaled to unit size first, so seconds and token counts sit in one well-conditioned
    system."""
    n = len(rows)
    if n <= p:
        return None
    ws = weights if weights is not None else [1.0] * n
    norm = [0.0] * p
    for (row, _), w in zip(rows, ws):
        for c, v in row.items():
            norm[c] += w * v * v
    if any(x <= 0 for x in norm):
        return None
    scale = [1.0 / math.sqrt(x) for x in norm]
    xtx = [[0.0] * p for _ in range(p)]
    xty = [0.0] * p
    yy = 0.0
    for (row, y), w in zip(rows, ws):
        items = [(c, v * scale[c]) for c, v in row.items()]
        for c, v in items:
            xty[c] += w * v * y
            r = xtx[c]
            for d, u in items:
                r[d] += w * v * u
        yy += w * y * y
    inv = _cholesky_inverse(xtx)
    if inv is None:
        return None
    beta = [sum(inv[i][j] * xty[j] for j in range(p)) for i in range(p)]
    # RSS = y'y - beta' X'y (exact for the least-squares beta)
    rss = max(0.0, yy - sum(b * v for b, v in zip(beta, xty)))
    sigma2 = rss / (n - p)
    coef = [b * scale[i] for i, b in enumerate(beta)]
    cov = [[inv[i][j] * sigma2 * scale[i] * scale[j] for j in range(p)] for i in range(p)]
    return coef, cov, rss


def fit_gpu(
    steps: Sequence[Step], works: Sequence[Work], shift: float = 0.0, weighted: bool = True
) -> Solution | None:
    """One GPU's fit with the steps moved `shift` s earlier; None when it is not
    determined (too few steps, or a phase that never ran apart from another).

    Weighted (the default), each step counts in inverse proportion to the energy the
    plain fit predicts for it (a step's error grows with its energy): a phase's joules
    per token is then a ratio of sums, as the truth is, rather than dominated by the
    steps that held the most tokens (a big batch, cheaper per token)."""
    steps = sorted(steps, key=lambda s: s.a)
    cols, rows = _rows(steps, works, shift)
    p = len(cols)
    if p < 2 or len(rows) < STEPS_PER_UNKNOWN * p:
        return None
    got = solve(rows, p)
    if got is not None and weighted:
        coef = got[0]
        fitted = [sum(coef[c] * v for c, v in row.items()) for row, _ in rows]
        floor = 0.1 * max(1e-9, sorted(fitted)[len(fitted) // 2])
        got = solve(rows, p, [1.0 / max(floor, f) for f in fitted]) or got
    if got is None:
        return None
    coef, cov, rss = got
    names = sorted(cols, key=cols.__getitem__)
    sol = Solution(names, coef, cov, rss, len(rows), shift)
    for w in works:
        for phase, _a, _b, tokens in w.windows():
            k = (w.key, phase)
            sol.requests[k] = sol.requests.get(k, 0) + 1
            sol.tokens[k] = sol.tokens.get(k, 0) + tokens
    for k in sol.requests:  # the phase's own running time: its windows' union
        spans = [
            (a, b) for w in works if w.key == k[0] for ph, a, b, _ in w.windows() if ph == k[1]
        ]
        sol.seconds[k] = sum(b - a for a, b in _merge(spans))
    return sol


def best_fit(
    steps: Sequence[Step], works: Sequence[Work], around: float | None = None
) -> Solution | None:
    """:func:`fit_gpu` at the shift that leaves the least residual: a coarse pass over
    :data:`COARSE_SHIFTS`, then steps of :data:`FINE_SHIFT` round the best. Given the
    shift found last time (`around`), only its neighbours are tried (the lag of a sensor
    path hardly changes; a sixth of the work)."""
    best: Solution | None = None
    tried: set[float] = set()

    def at(shift: float) -> None:
        nonlocal best
        shift = round(shift, 4)
        if shift in tried:
            return
        tried.add(shift)
        sol = fit_gpu(steps, works, shift, weighted=False)
        if sol is not None and (best is None or sol.rss < best.rss):
            best = sol

    if around is not None:
        for k in (-1, 0, 1):
            at(around + k * FINE_SHIFT)
    else:
        for s in COARSE_SHIFTS:
            at(s)
        if best is not None:
            centre = best.shift
            for k in (-3, -2, -1, 1, 2, 3):
                at(centre + k * FINE_SHIFT)
    if best is None:
        return None
    return fit_gpu(steps, works, best.shift)


# --- the figures ------------------------------------------------------------------------------


def figures(
    solutions: dict[str, Solution | None], serving: dict[str, set[GroupKey]]
) -> dict[GroupKey, dict[str, Figure]]:
    """Each group's figures from the fits of the GPUs that serve it (`serving`: GPU ->
    groups seen on it). A group on several GPUs (tensor parallel) draws on each: its
    joules per token are the sum over them, its variance too."""
    groups: dict[GroupKey, list[str]] = {}
    for gpu, keys in serving.items():
        for key in keys:
            groups.setdefault(key, []).append(gpu)
    out: dict[GroupKey, dict[str, Figure]] = {}
    for key, gpus in sorted(groups.items()):
        out[key] = {ph: _figure(key, ph, [(g, solutions.get(g)) for g in gpus]) for ph in PHASES}
    return out


def _figure(key: GroupKey, phase: str, fits: list[tuple[str, Solution | None]]) -> Figure:
    value = var = 0.0
    requests = tokens = 0
    seconds = 0.0
    for gpu, sol in fits:
        if sol is None:
            return Figure(
                unresolved=f"GPU {gpu}: too few energy-counter steps or requests to fit yet"
            )
        k = (key, phase)
        requests = max(requests, sol.requests.get(k, 0))
        tokens = max(tokens, sol.tokens.get(k, 0))
        seconds = max(seconds, sol.seconds.get(k, 0.0))
        if k not in sol.columns:
            return Figure(requests=requests, unresolved=f"no {phase} seen yet")
        i = sol.columns.index(k)
        value += sol.coef[i]
        var += sol.cov[i][i]
    if requests < MIN_REQUESTS:
        return Figure(
            requests=requests,
            unresolved=f"{requests} requests so far: a figure needs at least {MIN_REQUESTS}",
        )
    half = Z95 * math.sqrt(max(0.0, var))
    if value <= 0 or half > TIGHT * value:
        width = f"±{100 * half / value:.0f} %" if value > 0 else "not above zero"
        return Figure(
            requests=requests,
            unresolved=(
                f"{requests} requests so far: the 95 % interval is {width}, wider than "
                f"±{100 * TIGHT:.0f} %"
            ),
        )
    watts = value * tokens / seconds if seconds > 0 else None
    return Figure(value, value - half, value + half, watts, requests)
