"""What a real NVIDIA GPU's power sensors resolve, and what phasewatch makes of them.

Device command (repository root; .whl/ holds the wheels phasewatch needs that the device
lacks, fetched by tests/device/fetch_wheels.sh: an ignored folder the device run must carry;
timeout 540 s):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 setup.py -q build_ext --inplace && python3 tests/device/gpu_power_check.py --out $OUT/gpu_power.json

Dry run here (fake NVML, CPU torch if importable, else sleeps):

    python3 tests/device/gpu_power_check.py --dry-run --out /tmp/gpu_power.json

Sections, each time-boxed, each written to the JSON as soon as it ends (a failure of one
is recorded in its ``error`` and the next still runs; a watchdog writes what there is and
exits if the whole run overstays ``--budget``):

1. ``env``: GPU, driver, torch, pynvml, the phasewatch tree under test.
2. ``square``: a 1 ms NVML poll (tests/device/nvml_poll.py, its own process) of the
   instant and average power fields, ``nvmlDeviceGetPowerUsage`` and the energy counter,
   under a known square wave: compute-bound bf16 matmul bursts (prefill-like) and
   memory-bound copies (decode-like) of 0.1, 0.3, 1 and 3 s with idle gaps spread over a
   refresh period's phases, then 20 ms pulses. Per field: refresh period (median interval
   between value changes), lag (time to 50 % and 90 % of a step), the share of pulses it
   shows, and each burst's energy from counter deltas and from integrating each field,
   against the counter's energy above idle. ``sensor_profile`` gathers them.
3. ``phasewatch``: ``python -m proxy serve`` from this tree with NVML power, in front of
   a torch-backed stand-in engine (tests/device/standin_engine.py) whose prefill and
   decode last known times, sequential requests then a concurrent pair; its /metrics
   (per-phase power and energy, ``unresolved`` counters, sensor gauges: parsed
   generically) and its JSON access-log lines are compared with each phase's power
   fitted to the 1 ms counter poll with the schedule's edges known (:func:`schedule_fit`).

Unmeasured figures are ``null`` with a reason; NVML errors are recorded, not fatal.
Exit status: 0 when every section ran, 1 when one failed, 2 when there is no GPU.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import itertools
import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from array import array
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from standin_engine import MODEL, StandinEngine  # noqa: E402

FAKE_NVML = HERE / "fake_nvml"
PULSE_S = 0.02  # short compute pulses: what share of the time the instant field sees
PULSE_EVERY_S = 0.2
PULSES = 40
PULSES_QUICK = 10
SHORT_NAMES = {
    "instant_w": "NVML_FI_DEV_POWER_INSTANT",
    "average_w": "NVML_FI_DEV_POWER_AVERAGE",
    "usage_w": "nvmlDeviceGetPowerUsage",
    "counter_w": "nvmlDeviceGetTotalEnergyConsumption (deltas)",
}


# --------------------------------------------------------------------------- output


class Report:
    """The JSON result, rewritten whole (atomically) after every section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {
            "check": "gpu_power_check",
            "status": "running",
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1, default=_json_default) + "\n")
            os.replace(tmp, self.path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)


def _clean(obj: Any) -> Any:
    """NaN/inf to None, floats rounded, for JSON."""
    if isinstance(obj, float):
        return round(obj, 6) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def _pct(got: float | None, ref: float | None) -> float | None:
    if got is None or ref is None or not math.isfinite(got) or not math.isfinite(ref) or ref == 0:
        return None
    return 100.0 * (got - ref) / ref


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


# --------------------------------------------------------------------------- load


class Load:
    """Known load: ``burst(kind, seconds)`` keeps the device busy with compute-bound
    ("compute": bf16 matmuls) or memory-bound ("memory": large copies) work for that long
    and returns its (start, end) in monotonic seconds. With ``activity`` set, each burst is
    announced there (the fake NVML of the dry run reads it)."""

    def __init__(self, mode: str, activity: Path | None) -> None:
        self.mode = mode  # "cuda", "cpu-torch" or "sleep"
        self.activity = activity
        self.torch: Any = None
        self.ops: dict[str, Any] = {}
        self.per_op: dict[str, float] = {}
        self.info: dict[str, Any] = {"mode": mode}
        self.spans: list[dict] = []
        self.local = threading.local()

    def setup(self) -> None:
        if self.mode == "sleep":
            return
        import torch

        self.torch = torch
        if self.mode == "cuda":
            dev, n, dtype = "cuda", 8192, torch.bfloat16
            copy_bytes = 1 << 30
        else:
            dev, n, dtype = "cpu", 256, torch.float32
            copy_bytes = 16 << 20
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        c = torch.empty(n, n, device=dev, dtype=dtype)
        # random bits, as weights and KV caches are (constant data would toggle fewer bits)
        src = torch.randn(
            copy_bytes // 2, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float16
        )
        dst = torch.empty_like(src)
        self.ops = {
            "compute": lambda: torch.matmul(a, b, out=c),
            "memory": lambda: dst.copy_(src),
        }
        self.info.update(matmul_n=n, dtype=str(dtype), copy_bytes=copy_bytes, device=dev)
        for kind, op in self.ops.items():
            op()
            self._sync()
            reps = 10
            t0 = time.perf_counter()
            for _ in range(reps):
                op()
            self._sync()
            self.per_op[kind] = (time.perf_counter() - t0) / reps
        self.info["seconds_per_op"] = dict(self.per_op)
        if self.mode == "cuda":
            flops = 2 * n**3 / self.per_op["compute"]
            self.info["matmul_tflops"] = flops / 1e12
            self.info["copy_gb_per_s"] = 2 * copy_bytes / self.per_op["memory"] / 1e9

    def _sync(self) -> None:
        if self.mode == "cuda":
            self.torch.cuda.synchronize()

    def _announce(self, line: str) -> None:
        if self.activity is not None:
            with open(self.activity, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def burst(
        self,
        kind: str,
        seconds: float,
        tick: Any = None,
        tick_every: float | None = None,
    ) -> tuple[float, float]:
        if self.mode == "cuda" and not getattr(self.local, "bound", False):
            self.torch.cuda.set_device(0)  # a new thread (the engine's) has no context yet
            self.local.bound = True
        t0 = time.monotonic()
        self._announce(f"S {t0:.6f} {kind}")
        end = t0 + seconds
        next_tick = t0 + tick_every if tick_every else math.inf
        if self.mode == "sleep":
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if now >= next_tick:
                    tick()
                    next_tick += tick_every or math.inf
                time.sleep(max(0.0, min(end, next_tick) - now))
        else:
            op = self.ops[kind]
            # queue about 4 ms of work between synchronisations: edges within ~4 ms
            chunk = max(1, int(0.004 / max(self.per_op[kind], 1e-6)))
            while True:
                for _ in range(chunk):
                    op()
                self._sync()
                now = time.monotonic()
                if now >= next_tick:
                    tick()
                    next_tick += tick_every or math.inf
                if now + self.per_op[kind] * chunk / 2 >= end:
                    break
        t1 = time.monotonic()
        self._announce(f"E {t1:.6f}")
        self.spans.append({"kind": kind, "t0": t0, "t1": t1})
        return t0, t1


# --------------------------------------------------------------------------- NVML poll


class Poll:
    """tests/device/nvml_poll.py, one process per NVML read, and their rows once stopped:
    ``cols`` holds ``t_<what>`` (before the call), ``<what>``, ``t_end_<what>`` and
    ``ts_<what>`` (the value's NVML timestamp, fields only) for each read."""

    #: NVML_FI_DEV_ENERGY (nvml_poll.py's energy_field_mj) is left out: the same energy
    #: as the counter on the drivers seen, and each field read holds the driver for
    #: milliseconds on some GPUs (the H200: ~3 ms), slowing the other pollers' reads
    WHAT = ("instant_w", "average_w", "usage_w", "counter_mj")

    def __init__(
        self,
        workdir: Path,
        env: dict,
        gpu: int,
        max_seconds: float,
        tag: str,
        what: tuple[str, ...] = WHAT,
    ) -> None:
        self.bases = {w: workdir / f"poll_{tag}_{w}" for w in what}
        self.procs = {
            w: subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "nvml_poll.py"),
                    "--out",
                    str(base),
                    "--what",
                    w,
                    "--gpu",
                    str(gpu),
                    "--max-seconds",
                    str(max_seconds),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for w, base in self.bases.items()
        }
        self.meta: dict = {"errors": {}, "polls": {}}
        self.cols: dict[str, list[float]] = {}

    def started(self, timeout: float = 30.0) -> bool:
        """True once every poller is polling or was refused (each says so in OUT.ready),
        and at least one is polling."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for w, base in self.bases.items():
                ready = Path(str(base) + ".ready")
                if ready.exists():
                    with contextlib.suppress(ValueError, OSError):
                        states.append(json.loads(ready.read_text()).get("error") is None)
                        continue
                if self.procs[w].poll() is not None:
                    states.append(False)
                    continue
                break
            else:
                return any(states)
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 30.0) -> dict:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for w, proc in self.procs.items():
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            meta_path = Path(str(self.bases[w]) + ".json")
            if not meta_path.exists():
                self.meta["errors"][w] = (
                    f"poller wrote nothing: {out.decode(errors='replace')[-1000:]}"
                )
                continue
            meta = json.loads(meta_path.read_text())
            if meta.get("error"):
                self.meta["errors"][w] = meta["error"]
            self.meta["polls"][w] = meta.get("polls", 0)
            for k in ("name", "wall_minus_monotonic", "pynvml_file"):
                self.meta.setdefault(k, meta.get(k))
            rows = array("d")
            with open(str(self.bases[w]) + ".bin", "rb") as f:
                rows.frombytes(f.read())
            names = meta["columns"]
            k = len(names)
            for i, name in enumerate(names):
                key = w if name == "value" else f"{name}_{w}"
                self.cols[key] = list(rows[i::k])
        return self.meta


class Series:
    """One field as polled: sample times and values (sample-and-hold between them)."""

    def __init__(self, ts: list[float], vs: list[float]) -> None:
        pairs = [(t, v) for t, v in zip(ts, vs) if math.isfinite(t) and math.isfinite(v)]
        self.t = [p[0] for p in pairs]
        self.v = [p[1] for p in pairs]

    def __len__(self) -> int:
        return len(self.t)

    def changes(self) -> list[int]:
        return [i for i in range(1, len(self.v)) if self.v[i] != self.v[i - 1]]

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.t, t) - 1
        return self.v[i] if i >= 0 else math.nan

    def window(self, a: float, b: float) -> list[float]:
        i, j = bisect.bisect_left(self.t, a), bisect.bisect_right(self.t, b)
        return self.v[i:j]

    def integral(self, a: float, b: float) -> float:
        """Sample-and-hold integral over [a, b] (value x seconds)."""
        if not self.t or b <= a or a < self.t[0]:
            return math.nan
        i = max(0, bisect.bisect_right(self.t, a) - 1)
        total = 0.0
        while i < len(self.t) and self.t[i] < b:
            lo = max(a, self.t[i])
            hi = min(b, self.t[i + 1]) if i + 1 < len(self.t) else b
            if hi > lo:
                total += self.v[i] * (hi - lo)
            i += 1
        return total

    def first_crossing(self, a: float, b: float, level: float, rising: bool) -> float | None:
        i, j = bisect.bisect_left(self.t, a), bisect.bisect_right(self.t, b)
        for k in range(i, j):
            if (self.v[k] >= level) if rising else (self.v[k] <= level):
                return self.t[k]
        return None


class Counter:
    """The energy counter (mJ) as polled: its refresh points and the power between them."""

    def __init__(self, ts: list[float], mj: list[float]) -> None:
        raw = Series(ts, mj)
        self.raw = raw
        # the first poll that saw each new value: the refresh times (the very first poll
        # is not one: its value is from some refresh before it). A change seen after a
        # stall of the poller happened somewhere in the stall: not a time to rely on (the
        # values are cumulative, so dropping it only merges two intervals)
        gaps = sorted(b - a for a, b in itertools.pairwise(raw.t))
        slack = max(0.005, 5 * gaps[len(gaps) // 2]) if gaps else math.inf
        idx = [i for i in raw.changes() if raw.t[i] - raw.t[i - 1] <= slack]
        self.dropped = len(raw.changes()) - len(idx)
        self.pt = [raw.t[i] for i in idx]
        self.pe = [raw.v[i] / 1000.0 for i in idx]  # J
        # power between refreshes, held from one refresh point to the next
        pw_t, pw_v = [], []
        for i in range(1, len(self.pt)):
            dt = self.pt[i] - self.pt[i - 1]
            if dt > 0:
                pw_t.append(self.pt[i])
                pw_v.append((self.pe[i] - self.pe[i - 1]) / dt)
        # known once the refresh that ends its interval is seen (what a reader can know)
        self.power = Series(pw_t, pw_v)

    def energy_interp(self, t: float) -> float:
        """J at t, linear between refresh points (the counter's best estimate)."""
        if len(self.pt) < 2 or t < self.pt[0] or t > self.pt[-1]:
            return math.nan
        i = bisect.bisect_right(self.pt, t) - 1
        if i >= len(self.pt) - 1:
            return self.pe[-1]
        f = (t - self.pt[i]) / (self.pt[i + 1] - self.pt[i])
        return self.pe[i] + f * (self.pe[i + 1] - self.pe[i])

    def energy_raw(self, t: float) -> float:
        """J at t as a reader polling then would have seen it."""
        return self.raw.at(t) / 1000.0

    def between(self, a: float, b: float, interp: bool = True) -> float:
        f = self.energy_interp if interp else self.energy_raw
        return f(b) - f(a)


def trace(poll: Poll) -> dict:
    """Each polled column at its change points, [monotonic s, value]: the raw sensor
    behaviour, small enough to keep (sample-and-hold between points restores it)."""
    c = poll.cols
    out: dict[str, Any] = {}
    for name in poll.bases:
        s = Series(c.get(f"t_{name}", []), c.get(name, []))
        idx = [0, *s.changes()] if len(s) else []
        out[name] = [[round(s.t[i], 6), s.v[i]] for i in idx]
    return out


def schedule_fit(counter: Counter, spans: list[tuple[float, float]], pad: float = 1.0) -> dict:
    """Each known span's mean power, fitted to the energy counter (least squares).

    The timeline from ``pad`` before the first span to ``pad`` after the last is cut at
    every span edge; what no span covers is idle, one unknown per idle stretch (idle power
    drifts with temperature). Each counter refresh interval's energy is the sum of the
    pieces' powers times their overlap with it. With the edges known, a span shorter than
    a refresh is still solved from its neighbours, unlike any window read of the counter.
    Returns ``{"span_w": [...], "idle_w": [...], "rms_residual_w": ...}``.
    """
    if not spans or len(counter.pt) < 3:
        return {"error": "no spans or no counter"}
    lo = max(min(a for a, _ in spans) - pad, counter.pt[0])
    hi = min(max(b for _, b in spans) + pad, counter.pt[-1])
    pieces: list[tuple[float, float, int]] = []  # start, end, unknown index
    n_spans = len(spans)
    order = sorted(range(n_spans), key=lambda i: spans[i][0])
    t, k = lo, n_spans
    for i in order:
        a, b = spans[i]
        if a - t > 0.005:
            pieces.append((t, a, k))
            k += 1
        elif pieces and a > t:  # a sliver between two spans: the previous one's
            s0, _, j = pieces[-1]
            pieces[-1] = (s0, a, j)
        pieces.append((max(a, t), b, i))
        t = max(t, b)
    if hi > t:
        pieces.append((t, hi, k))
        k += 1
    n = k
    ata = [[0.0] * n for _ in range(n)]
    atb = [0.0] * n
    rows = []
    starts = [p[0] for p in pieces]
    for i in range(1, len(counter.pt)):
        t0, t1 = counter.pt[i - 1], counter.pt[i]
        if t0 < lo or t1 > hi:
            continue
        de = counter.pe[i] - counter.pe[i - 1]
        row: dict[int, float] = {}
        j = max(0, bisect.bisect_right(starts, t0) - 1)
        while j < len(pieces) and pieces[j][0] < t1:
            ov = min(t1, pieces[j][1]) - max(t0, pieces[j][0])
            if ov > 0:
                row[pieces[j][2]] = row.get(pieces[j][2], 0.0) + ov
            j += 1
        if not row:
            continue
        rows.append((row, de, t1 - t0))
        for a_i, va in row.items():
            atb[a_i] += va * de
            for b_i, vb in row.items():
                ata[a_i][b_i] += va * vb
    seen = [i for i in range(n) if ata[i][i] > 0]  # pieces outside the counter's range
    sub = [[ata[i][j] for j in seen] for i in seen]
    rhs = [atb[i] for i in seen]
    note = None
    x_seen = _solve(sub, rhs)
    if x_seen is None:  # some pieces are seen only together (refreshes lost to stalls)
        ridge = 1e-6 * max((sub[i][i] for i in range(len(seen))), default=1.0)
        x_seen = _solve(
            [
                [v + (ridge if r == c else 0.0) for c, v in enumerate(row)]
                for r, row in enumerate(sub)
            ],
            rhs,
        )
        note = "rank-deficient (refresh points lost to poller stalls): a ridge split pieces seen only together"
        if x_seen is None:
            return {"error": "the fit is singular"}
    x: list[float | None] = [None] * n
    for i, v in zip(seen, x_seen):
        x[i] = v
    res2 = [
        ((sum(v * (x[c] or 0.0) for c, v in row.items()) - de) / dt) ** 2
        for row, de, dt in rows
        if dt > 0
    ]
    return {
        "span_w": x[:n_spans],
        "idle_w": x[n_spans:],
        "note": note,
        "intervals": len(rows),
        "rms_residual_w": math.sqrt(statistics.fmean(res2)) if res2 else None,
    }


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9 * max(1.0, max(abs(m[r][r]) for r in range(n))):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def load_fields(poll: Poll) -> tuple[dict[str, Series], Counter | None, dict]:
    c = poll.cols
    fields: dict[str, Series] = {}
    for name in ("instant_w", "average_w", "usage_w"):
        s = Series(c.get(f"t_{name}", []), c.get(name, []))
        if len(s):
            fields[name] = s
    counter = Counter(c.get("t_counter_mj", []), c.get("counter_mj", []))
    if len(counter.pt) < 3:
        counter_opt = None
    else:
        counter_opt = counter
        fields["counter_w"] = counter.power

    def call_s(w: str) -> float | None:
        return _median(
            [
                y - x
                for x, y in zip(c.get(f"t_{w}", []), c.get(f"t_end_{w}", []))
                if math.isfinite(y - x)
            ]
        )

    def interval(w: str, q: float) -> float | None:
        ts = [t for t in c.get(f"t_{w}", []) if math.isfinite(t)]
        d = sorted(b - a for a, b in itertools.pairwise(ts))
        return d[int(q * (len(d) - 1))] if d else None

    # the fields' own timestamps: how old a value is when read, how often they move
    stamps: dict[str, Any] = {}
    offset = poll.meta.get("wall_minus_monotonic")
    for name in ("instant_w", "average_w"):
        ts = Series(c.get(f"t_{name}", []), c.get(f"ts_us_{name}", []))
        if not len(ts) or offset is None:
            continue
        ages = [(t + offset) - v / 1e6 for t, v in zip(ts.t, ts.v) if v > 0]
        moved = [ts.t[i] for i in ts.changes()]
        stamps[name] = {
            "age_median_s": _median(ages),
            "timestamp_changes": len(moved),
            "timestamp_period_s": _median([b - a for a, b in itertools.pairwise(moved)]),
        }
    info = {
        "field_timestamps": stamps or None,
        "call_median_s": {w: call_s(w) for w in poll.bases},
        "poll_interval_median_s": {w: interval(w, 0.5) for w in poll.bases},
        "poll_interval_p99_s": {w: interval(w, 0.99) for w in poll.bases},
        "polls": poll.meta.get("polls"),
        "counter_changes_dropped_after_a_stall": counter.dropped,
        "errors": poll.meta.get("errors", {}),
        "gpu_name": poll.meta.get("name"),
    }
    return fields, counter_opt, info


def refresh_stats(s: Series, counter: Counter | None, name: str) -> dict:
    if name == "counter_w" and counter is not None:
        ts = counter.pt
    else:
        ts = [s.t[i] for i in s.changes()]
    d = [b - a for a, b in itertools.pairwise(ts)]
    if not d:
        return {"changes": len(ts), "refresh_period_s": None, "note": "value never changed"}
    d_sorted = sorted(d)
    return {
        "changes": len(ts),
        "refresh_period_s": statistics.median(d),
        "refresh_p10_s": d_sorted[int(0.1 * (len(d) - 1))],
        "refresh_p90_s": d_sorted[int(0.9 * (len(d) - 1))],
    }


# --------------------------------------------------------------------------- square wave


def _spread(i: int) -> float:
    """0 <= x < 0.1 s, evenly spread over i (golden-ratio steps): added to idle gaps so
    that burst edges do not stay in one phase of a sensor refreshed every 100 ms."""
    return 0.1 * ((i * 0.6180339887) % 1.0)


def square_schedule(quick: bool) -> list[tuple[str, float, float]]:
    """(kind, burst seconds, idle seconds after it)."""
    if quick:
        durs = [(0.1, 0.6), (0.3, 0.6), (2.0, 1.3)]
    else:
        durs = [(0.1, 1.5)] * 3 + [(0.3, 1.5)] * 3 + [(1.0, 2.0)] * 2 + [(3.0, 2.5)]
    plan = [(k, d, g) for k in ("compute", "memory") for d, g in durs]
    return [(k, d, g + _spread(i)) for i, (k, d, g) in enumerate(plan)]


def run_square(
    load: Load, workdir: Path, env: dict, gpu: int, quick: bool, deadline: float
) -> dict:
    sched = square_schedule(quick)
    budget = sum(d + g for _, d, g in sched) + 10 + PULSES * (PULSE_EVERY_S + 0.1)
    poll = Poll(
        workdir, env, gpu, min(budget + 30, max(10.0, deadline - time.monotonic())), "square"
    )
    bursts: list[dict] = []
    pulses: list[dict] = []
    out: dict[str, Any] = {
        "schedule": [list(x) for x in sched],
        "bursts": bursts,
        "pulses": pulses,
    }
    try:
        if not poll.started():
            raise RuntimeError("NVML poller exited at start")
        lead = 1.0 if quick else 2.5
        t_lead = time.monotonic()
        time.sleep(lead)
        out["idle_lead"] = [t_lead + 0.3, time.monotonic()]
        for kind, dur, gap in sched:
            if time.monotonic() + dur + gap > deadline:
                out["cut_short"] = f"time box reached before a {kind} {dur} s burst"
                break
            t0, t1 = load.burst(kind, dur)
            time.sleep(gap)
            bursts.append({"kind": kind, "nominal_s": dur, "t0": t0, "t1": t1, "gap_s": gap})
        # short compute pulses at spread phases: how much of the time the instant field
        # sees (a pulse is seen when it overlaps the field's averaging window)
        # starts on an absolute plan, so their phases over a refresh period are spread
        # evenly (golden-ratio offsets), not a sum of offsets
        start = time.monotonic()
        for i in range(PULSES_QUICK if quick else PULSES):
            if time.monotonic() + 1.0 > deadline:
                out["cut_short"] = "time box reached during the pulses"
                break
            time.sleep(max(0.0, start + i * PULSE_EVERY_S + _spread(i) - time.monotonic()))
            t0, t1 = load.burst("compute", PULSE_S)
            pulses.append({"t0": t0, "t1": t1})
        time.sleep(PULSE_EVERY_S)
        time.sleep(0.3)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        poll.stop()
    if "idle_lead" not in out:
        return out
    fields, counter, info = load_fields(poll)
    out["poll"] = info
    out["trace"] = trace(poll)
    out.update(analyse_square(fields, counter, bursts, out["idle_lead"]))
    out["pulse_visibility"] = analyse_pulses(fields, counter, pulses, out)
    out["sensor_profile"] = sensor_profile(out)
    return out


def analyse_pulses(
    fields: dict[str, Series], counter: Counter | None, pulses: list[dict], sq: dict
) -> dict:
    """Per field: the share of short pulses it shows at all, and (instant field) the
    averaging window that share implies: a pulse of length p is seen when it overlaps a
    window W refreshed every R, with probability (p + W) / R at spread phases."""
    if not pulses:
        return {"error": "no pulses ran"}
    res: dict[str, Any] = {
        "pulses": len(pulses),
        "pulse_s": _median([p["t1"] - p["t0"] for p in pulses]),
    }
    span = (pulses[0]["t0"] - 0.05, pulses[-1]["t1"] + 0.2)
    ref_excess = None
    idle = sq["idle_w"]
    if counter is not None and idle.get("counter_w") is not None:
        ref_excess = counter.between(*span) - idle["counter_w"] * (span[1] - span[0])
        res["counter_excess_j"] = ref_excess
    for name, s in fields.items():
        top = sq["plateau_w"]["compute"].get(name)
        base = idle.get(name)
        if top is None or base is None or top - base < 5:
            res[name] = {"error": "no step size for this field"}
            continue
        seen = 0
        ratios = []
        for p in pulses:
            # against the level just before the pulse: a slow field carries the whole
            # train's mean, which is not this pulse
            local = _median(s.window(p["t0"] - 0.09, p["t0"] - 0.005))
            lvl = base if local is None else local
            peak = max(s.window(p["t0"], p["t1"] + 0.15) or [math.nan])
            ratios.append((peak - lvl) / (top - base))
            if peak - lvl > 0.15 * (top - base):
                seen += 1
        row: dict[str, Any] = {"seen_fraction": seen / len(pulses)}
        # a pulse wholly inside a window W > p reads p / W of the step at most
        ratios.sort()
        high = ratios[-2] if len(ratios) >= 2 else None  # the second highest: one outlier
        row["peak_ratio"] = high
        if name != "counter_w":
            excess = s.integral(*span) - base * (span[1] - span[0])
            row["energy_above_idle_vs_counter_pct"] = _pct(excess, ref_excess)
        refresh = sq["fields"].get(name, {}).get("refresh_period_s")
        if name == "instant_w" and refresh:
            # rough: the threshold trims a little off each side of the overlap
            row["window_estimate_s"] = max(0.0, row["seen_fraction"] * refresh - res["pulse_s"])
            if high is not None and 0.05 < high < 0.95:
                row["window_from_peak_s"] = res["pulse_s"] / high
            elif high is not None and high >= 0.95:
                row["window_from_peak_s"] = f"<= {res['pulse_s']:.3f} (pulses read in full)"
        res[name] = row
    return res


def sensor_profile(sq: dict) -> dict:
    """The figures a simulator sensor profile needs, in one place."""
    prof: dict[str, Any] = {
        "gpu": sq.get("poll", {}).get("gpu_name"),
        "poll_interval_s": sq.get("poll", {}).get("poll_interval_median_s"),
        "unsupported": sq.get("poll", {}).get("errors") or {},
    }
    for name, f in sq.get("fields", {}).items():
        lag = f.get("lag", {}).get("compute", {})
        entry = {
            "source": f.get("source"),
            "refresh_s": f.get("refresh_period_s"),
            "rise_to_50pct_s": lag.get("rise_to_50pct_s"),
            "rise_to_90pct_s": lag.get("rise_to_90pct_s"),
            "fall_to_50pct_s": lag.get("fall_to_50pct_s"),
        }
        r50 = lag.get("rise_to_50pct_s")
        entry["looks_like"] = (
            None if r50 is None else "1 s mean" if r50 > 0.3 else "instant or short window"
        )
        stamp = (sq.get("poll", {}).get("field_timestamps") or {}).get(name)
        if stamp:
            entry["field_timestamp"] = stamp
        vis = sq.get("pulse_visibility", {}).get(name)
        if isinstance(vis, dict):
            entry["pulse_seen_fraction"] = vis.get("seen_fraction")
            for k in ("window_estimate_s", "window_from_peak_s"):
                if k in vis:
                    entry[k] = vis[k]
        prof[name] = entry
    return prof


def analyse_square(
    fields: dict[str, Series], counter: Counter | None, bursts: list[dict], lead: list[float]
) -> dict:
    res: dict[str, Any] = {"fields": {}}
    idle = {name: _median(s.window(lead[0], lead[1])) for name, s in fields.items()}
    res["idle_w"] = idle
    # plateau per kind and field: the last second of the longest burst of that kind
    plateau: dict[str, dict[str, float | None]] = {}
    for kind in ("compute", "memory"):
        longest = max(
            (b for b in bursts if b["kind"] == kind), key=lambda b: b["t1"] - b["t0"], default=None
        )
        plateau[kind] = {}
        for name, s in fields.items():
            if longest is None or longest["t1"] - longest["t0"] < 1.9:  # the 1 s mean settled
                plateau[kind][name] = None
                continue
            a = max(longest["t0"], longest["t1"] - 1.0)
            plateau[kind][name] = _median(s.window(a, longest["t1"]))
    res["plateau_w"] = plateau
    for name, s in fields.items():
        f: dict[str, Any] = {"source": SHORT_NAMES[name], "samples": len(s)}
        f.update(refresh_stats(s, counter, name))
        lags: dict[str, Any] = {}
        for kind in ("compute", "memory"):
            top = plateau[kind].get(name)
            rises50, rises90, falls50, peaks = [], [], [], {}
            for b in bursts:
                if b["kind"] != kind:
                    continue
                base = _median(s.window(b["t0"] - 1.0, b["t0"] - 0.02))
                if top is None or base is None or top - base < 5:
                    continue
                nxt = b["t1"] + b["gap_s"]
                dur = b["t1"] - b["t0"]
                peak = max(s.window(b["t0"], nxt) or [math.nan])
                peaks.setdefault(str(b["nominal_s"]), []).append((peak - base) / (top - base))
                if dur >= 0.9:
                    r50 = s.first_crossing(b["t0"], nxt, base + 0.5 * (top - base), True)
                    r90 = s.first_crossing(b["t0"], nxt, base + 0.9 * (top - base), True)
                    f50 = s.first_crossing(b["t1"], nxt, base + 0.5 * (top - base), False)
                    rises50.append(r50 - b["t0"] if r50 is not None else math.nan)
                    rises90.append(r90 - b["t0"] if r90 is not None else math.nan)
                    falls50.append(f50 - b["t1"] if f50 is not None else math.nan)
            lags[kind] = {
                "rise_to_50pct_s": _median(rises50),
                "rise_to_90pct_s": _median(rises90),
                "fall_to_50pct_s": _median(falls50),
                "peak_fraction_of_step_by_burst_s": {k: _median(v) for k, v in peaks.items()},
            }
        f["lag"] = lags
        res["fields"][name] = f
    # energy per burst
    res["energy"] = energy_per_burst(fields, counter, bursts, idle)
    return res


def energy_per_burst(
    fields: dict[str, Series], counter: Counter | None, bursts: list[dict], idle: dict
) -> dict:
    """Each burst's energy over its own window by each method, against the truth taken
    from the counter: idle power x duration + the counter's energy above idle over a window
    padded to take in any lag."""
    if counter is None:
        return {"error": "no energy counter: no reference energy"}
    idle_w = idle.get("counter_w")
    if idle_w is None:
        return {"error": "no idle power from the counter"}
    fit = schedule_fit(counter, [(b["t0"], b["t1"]) for b in bursts])
    fit_w = fit.get("span_w") or [None] * len(bursts)
    rows = []
    for b, fw in zip(bursts, fit_w):
        dur = b["t1"] - b["t0"]
        pa, pb = b["t0"] - 0.2, b["t1"] + min(b["gap_s"] - 0.1, 1.3)
        excess = counter.between(pa, pb) - idle_w * (pb - pa)
        truth = idle_w * dur + excess
        row: dict[str, Any] = {
            "kind": b["kind"],
            "nominal_s": b["nominal_s"],
            "duration_s": dur,
            "truth_j": truth,
            "truth_mean_w": truth / dur if dur > 0 else None,
            "fit_mean_w": fw,
            "window_j": {},
            "window_err_pct": {},
        }
        est = {
            "counter_raw_delta": counter.between(b["t0"], b["t1"], interp=False),
            "counter_interp_delta": counter.between(b["t0"], b["t1"], interp=True),
        }
        for name, s in fields.items():
            if name != "counter_w":
                est[f"integral_{name}"] = s.integral(b["t0"], b["t1"])
        for k, v in est.items():
            row["window_j"][k] = v
            row["window_err_pct"][k] = _pct(v, truth)
        rows.append(row)
    summary: dict[str, Any] = {}
    for kind in ("compute", "memory"):
        for nominal in sorted({r["nominal_s"] for r in rows}):
            sel = [r for r in rows if r["kind"] == kind and r["nominal_s"] == nominal]
            if not sel:
                continue
            summary[f"{kind}_{nominal:g}s"] = {
                "truth_mean_w": _median([r["truth_mean_w"] for r in sel]),
                "fit_mean_w": _median([r["fit_mean_w"] for r in sel]),
                "median_err_pct": {
                    k: _median([r["window_err_pct"][k] for r in sel])
                    for k in sel[0]["window_err_pct"]
                },
            }
    fit.pop("span_w", None)
    return {
        "idle_w_from_counter": idle_w,
        "per_burst": rows,
        "summary": summary,
        "fit": fit,
        "truth_note": "truth_mean_w: idle x duration + the counter's energy above idle over "
        "the burst padded by 0.2 s before and up to 1.3 s after; fit_mean_w: the burst's "
        "power fitted to every counter refresh with the schedule's edges known",
    }


# --------------------------------------------------------------------------- phasewatch

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_POWER_FAMILY = re.compile(r"power|energy|joule|watt|unresolved|sensor|nvml|idle")


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """phasewatch samples about power from a Prometheus text page, keyed by (name, labels)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith("phasewatch_"):
            continue
        if not _POWER_FAMILY.search(m.group(1)):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out[(m.group(1), labels)] = value
    return out


def metric_delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _sum(d: dict, name: str, **labels: str) -> float | None:
    vals = [
        v
        for (n, lab), v in d.items()
        if n == name and all((k, val) in lab for k, val in labels.items())
    ]
    return sum(vals) if vals else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only
    try:
        with opener.open(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except OSError as exc:
        code = getattr(exc, "code", 0)
        return int(code or 0), str(exc)


def chat(port: int, prefill_s: float, decode_s: float, tokens: int, timeout: float) -> dict:
    """One streamed chat completion through the proxy, read to the end (raw HTTP/1.1 on
    a socket: no client library needed)."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "power check"}],
            "stream": True,
            "max_tokens": tokens,
            "standin": {"prefill_s": prefill_s, "decode_s": decode_s},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    t_send = time.monotonic()
    data = b""
    t_first = None
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        deadline = t_send + timeout
        while time.monotonic() < deadline:
            got = s.recv(65536)
            if not got:
                break
            data += got
            if t_first is None and b"data: {" in data:
                t_first = time.monotonic()
    t_end = time.monotonic()
    wall_end = time.time()
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    rid = re.search(rb'"id": ?"(chatcmpl-[0-9a-f]+)"', data)
    return {
        "id": rid.group(1).decode() if rid else None,
        "status": status,
        "t_send": t_send,
        "t_first": t_first,
        "t_end": t_end,
        "wall_end": wall_end,
        "done": b"[DONE]" in data,
        "chunks": data.count(b"data: {"),
        "usage_seen": b'"usage"' in data,
    }


def run_concurrent(port: int, engine: StandinEngine, quick: bool) -> dict:
    """Two overlapping requests between two scrapes (analysed after the poll stopped)."""
    _, text = _get(f"http://127.0.0.1:{port}/metrics")
    t_before = time.monotonic()
    got: list[dict] = []

    def one(prefill_s: float, decode_s: float, tokens: int) -> None:
        r = chat(port, prefill_s, decode_s, tokens, timeout=prefill_s + decode_s + 30)
        r.update(prefill_s=prefill_s, decode_s=decode_s, tokens=tokens)
        got.append(r)

    pair = [(0.2, 0.6, 12), (0.3, 0.4, 8)] if quick else [(0.3, 2.0, 64), (0.5, 1.0, 32)]
    threads = [threading.Thread(target=one, args=args) for args in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    time.sleep(1.0 if quick else 2.0)
    _, text2 = _get(f"http://127.0.0.1:{port}/metrics")
    t_after = time.monotonic()
    by_id = {t["id"]: t for t in engine.log}
    for r in got:
        r["engine"] = by_id.get(r["id"])
    return {
        "requests": got,
        "scrape_window": [t_before, t_after],
        "metrics_before": parse_metrics(text),
        "metrics_after": parse_metrics(text2),
    }


def conservation(d: dict, counter: Counter | None, window: list[float] | None) -> dict:
    """Energy over a scrape window: phasewatch's GPU total against the counter, and
    requests' attributed energy plus any idle energy family against that total."""
    gpu = _sum(d, "phasewatch_gpu_energy_joules_total")
    req = _sum(d, "phasewatch_request_energy_joules_total")
    energy = [
        (n, dict(lab), v)
        for (n, lab), v in d.items()
        if ("energy" in n or "joule" in n) and n.endswith("_total")
    ]
    idle_vals = [v for n, _, v in energy if "idle" in n]
    idle = sum(idle_vals) if idle_vals else None
    phase_vals = [v for n, lab, v in energy if "phase" in lab and "idle" not in n]
    by_phase = sum(phase_vals) if phase_vals else None
    attributed = by_phase if by_phase is not None else req
    ref = counter.between(*window) if counter is not None and window else None
    notes = []
    if idle is None:
        notes.append("no idle energy family in /metrics")
    if by_phase is None:
        notes.append("no per-phase energy family: attributed = request_energy (by client)")
    return {
        "counter_j": ref,
        "phasewatch_gpu_energy_j": gpu,
        "gpu_energy_err_pct": _pct(gpu, ref),
        "phasewatch_request_energy_j": req,
        "phasewatch_phase_energy_j": by_phase,
        "phasewatch_idle_energy_j": idle,
        "attributed_plus_idle_vs_gpu_pct": _pct(attributed + (idle or 0.0), gpu)
        if attributed is not None
        else None,
        "note": "; ".join(notes) or None,
    }


def run_phasewatch(
    load: Load,
    workdir: Path,
    env: dict,
    gpu: int,
    quick: bool,
    deadline: float,
    extra_args: list[str],
) -> dict:
    out: dict[str, Any] = {}
    engine = StandinEngine(load).start()
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "proxy",
        "serve",
        "--upstream",
        f"standin=http://127.0.0.1:{engine.port}",
        "--engine",
        "standin=openai",
        "--port",
        str(port),
        "--power-source",
        "nvml",
        "--log-format",
        "json",
        *extra_args,
    ]
    out["command"] = " ".join(cmd[1:])
    log_path = workdir / "phasewatch.log"
    logf = open(log_path, "wb")  # closed in finally
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
    poll: Poll | None = None
    before: dict = {}
    after: dict = {}
    requests: list[dict] = []
    out["requests"] = requests
    try:
        # ready: /metrics answers and the model list was taken
        t_start = time.monotonic()
        ready_by = min(deadline, t_start + 90)
        text = ""
        while time.monotonic() < ready_by:
            if proc.poll() is not None:
                raise RuntimeError(f"phasewatch exited with {proc.returncode} at start")
            code, text = _get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            if code == 200:
                break
            time.sleep(0.3)
        else:
            raise RuntimeError("phasewatch did not answer /metrics in time")
        out["start_s"] = time.monotonic() - t_start
        sampling = re.findall(r"^phasewatch_power_sampling_up\{([^}]*)\}\s+(\S+)", text, re.M)
        out["power_sampling_up_at_start"] = sampling
        # a warm-up request (not measured): proxy, engine and GPU on their paths
        warm = chat(port, 0.05, 0.1, 4, timeout=30)
        out["warmup"] = {"status": warm["status"], "done": warm["done"]}
        if warm["status"] != 200:
            raise RuntimeError(f"warm-up request answered {warm['status']}")
        time.sleep(1.0)
        plan = (
            [(0.3, 0.6, 16), (0.3, 1.0, 24)]
            if quick
            else 2
            * [
                (0.3, 1.0, 32),
                (1.0, 3.0, 96),
                (0.3, 3.0, 96),
                (1.0, 1.0, 32),
                (0.1, 0.5, 16),
                (3.0, 2.0, 64),
            ]
        )
        gap = 0.8 if quick else 2.0
        # the counter alone: each read holds the driver for milliseconds on some GPUs,
        # and phasewatch's own reads must not queue behind this check's
        poll = Poll(
            workdir,
            env,
            gpu,
            max(10.0, deadline - time.monotonic() + 5),
            "phasewatch",
            what=("counter_mj",),
        )
        if not poll.started():
            raise RuntimeError("NVML poller exited at start")
        time.sleep(1.0)  # a few counter refreshes before the first window opens
        _, text = _get(f"http://127.0.0.1:{port}/metrics")
        t_before = time.monotonic()
        before = parse_metrics(text)
        n_logged = len(engine.log)
        for prefill_s, decode_s, tokens in plan:
            if time.monotonic() + prefill_s + decode_s + gap + 10 > deadline:
                out["cut_short"] = "time box reached"
                break
            r = chat(port, prefill_s, decode_s, tokens, timeout=prefill_s + decode_s + 30)
            r.update(prefill_s=prefill_s, decode_s=decode_s, tokens=tokens)
            requests.append(r)
            time.sleep(gap + _spread(len(requests)))
        # wait until phasewatch observed every request's decode power (or 10 s)
        want = len(requests)
        wait_by = min(deadline, time.monotonic() + 10)
        while True:
            _, text = _get(f"http://127.0.0.1:{port}/metrics")
            t_after = time.monotonic()
            after = parse_metrics(text)
            d = metric_delta(before, after)
            seen = _sum(d, "phasewatch_gpu_power_watts_count", phase="decode") or 0
            if seen >= want or time.monotonic() > wait_by:
                break
            time.sleep(0.5)
        out["scrape_window"] = [t_before, t_after]
        by_id = {t["id"]: t for t in engine.log[n_logged:]}
        for r in requests:
            r["engine"] = by_id.get(r["id"])
        # two requests at once, in a scrape window of their own: phasewatch's sharing
        # and its energy conservation (the engine serialises their GPU work)
        if time.monotonic() + 15 < deadline:
            out["concurrent"] = run_concurrent(port, engine, quick)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        with contextlib.suppress(Exception):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
        out["exit_code"] = proc.returncode
        engine.stop()
        if poll is not None:
            poll.stop()
        out["log"] = read_log(log_path)
    if poll is None or not before:
        return out
    fields, counter, info = load_fields(poll)
    out["poll"] = info
    out["trace"] = trace(poll)
    out["metrics_delta"] = [
        {"name": n, "labels": dict(lab), "delta": v}
        for (n, lab), v in sorted(metric_delta(before, after).items())
        if not n.endswith("_bucket")
    ]
    out["metrics_after"] = [
        {"name": n, "labels": dict(lab), "value": v}
        for (n, lab), v in sorted(after.items())
        if not n.endswith("_bucket")
    ]
    out.update(compare_phasewatch(fields, counter, requests, before, after, out))
    conc = out.get("concurrent")
    if conc:
        d2 = metric_delta(conc.pop("metrics_before"), conc.pop("metrics_after"))
        conc["energy"] = conservation(d2, counter, conc["scrape_window"])
        conc["unresolved_delta"] = {
            f"{n}{{phase={dict(lab).get('phase', '')}}}": v
            for (n, lab), v in d2.items()
            if "unresolved" in n
        } or None
        conc["phase_power_observations"] = {
            ph: _sum(d2, "phasewatch_gpu_power_watts_count", phase=ph)
            for ph in ("prefill", "decode")
        }
    return out


def read_log(path: Path) -> dict:
    """Power-related lines of phasewatch's log: start-up lines naming power, NVML or a
    sensor, warnings, and each access line's power fields."""
    text = path.read_text(errors="replace") if path.exists() else ""
    notable, access = [], []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            if re.search(r"(?i)power|nvml|sensor|error|traceback", line):
                notable.append(line[:400])
            continue
        if not isinstance(rec, dict):
            continue
        keys = {k for k in rec if re.search(r"watts|energy|joule|unresolved|resolved", k)}
        if rec.get("logger") == "proxy.access" or keys:
            keep = {k: rec[k] for k in sorted(keys)}
            for k in ("ts", "request_id", "ttft_s", "request_s", "status"):
                if k in rec:
                    keep[k] = rec[k]
            access.append(keep)
        elif re.search(r"(?i)power|nvml|sensor|energy", json.dumps(rec)) or rec.get("level") in (
            "warning",
            "error",
            "WARNING",
            "ERROR",
        ):
            notable.append(json.dumps(rec)[:400])
    return {
        "notable": notable[-40:],
        "access_power_fields": access,
        "tail": text.splitlines()[-15:],
    }


def compare_phasewatch(
    fields: dict[str, Series],
    counter: Counter | None,
    requests: list[dict],
    before: dict,
    after: dict,
    out: dict,
) -> dict:
    res: dict[str, Any] = {}
    d = metric_delta(before, after)
    # phasewatch's per-phase mean power over these requests
    pw_phase = {}
    for phase in ("prefill", "decode"):
        s = _sum(d, "phasewatch_gpu_power_watts_sum", phase=phase)
        c = _sum(d, "phasewatch_gpu_power_watts_count", phase=phase)
        pw_phase[phase] = {"observations": c, "mean_w": (s / c) if s is not None and c else None}
    res["phasewatch_phase_power"] = pw_phase
    # every watt histogram with a phase label, whatever it is called
    other: dict[str, Any] = {}
    for (n, lab), v in d.items():
        labels = dict(lab)
        if n.endswith("_sum") and "watt" in n and "phase" in labels:
            c = d.get((n[: -len("_sum")] + "_count", lab))
            key = f"{n[: -len('_sum')]}{{phase={labels['phase']}}}"
            item = other.setdefault(key, {"sum": 0.0, "count": 0.0})
            item["sum"] += v
            item["count"] += c or 0.0
    for item in other.values():
        item["mean_w"] = item["sum"] / item["count"] if item["count"] else None
    res["phasewatch_phase_watt_histograms"] = other or None
    unresolved: dict[str, float] = {}
    for (n, lab), v in d.items():
        if "unresolved" in n:
            key = f"{n}{{phase={dict(lab).get('phase', '')}}}"
            unresolved[key] = unresolved.get(key, 0.0) + v
    res["phasewatch_unresolved_delta"] = unresolved or None
    if counter is None:
        res["reference"] = {"error": "no energy counter in the poll: no reference"}
        return res
    inst = fields.get("instant_w")
    known = [r for r in requests if "prefill" in (r.get("engine") or {})]
    # the concurrent pair's GPU work is known too (and is not idle): fitted after these
    also = [r for r in (out.get("concurrent") or {}).get("requests", []) if (r.get("engine") or {})]
    spans = [tuple(r["engine"][ph]) for r in known + also for ph in ("prefill", "decode")]
    fit = schedule_fit(counter, spans)  # type: ignore[arg-type]
    fit_w = fit.pop("span_w", None) or [None] * len(spans)
    res["schedule_fit"] = fit
    per_req = []
    for n_req, r in enumerate(known):
        e = r["engine"]
        row: dict[str, Any] = {
            "prefill_s": r["prefill_s"],
            "decode_s": r["decode_s"],
            "wall_end": r["wall_end"],
        }
        for phase, (a, b) in (("prefill", e["prefill"]), ("decode", e["decode"])):
            dur = b - a
            row[f"{phase}_duration_s"] = dur
            row[f"{phase}_counter_w"] = counter.between(a, b) / dur if dur > 0 else None
            row[f"{phase}_instant_w"] = (
                inst.integral(a, b) / dur if inst is not None and dur > 0 else None
            )
            row[f"{phase}_fit_w"] = fit_w[2 * n_req + (phase == "decode")]
            # the reference: the fit where it solved, else the counter over the window
            fw = row[f"{phase}_fit_w"]
            row[f"{phase}_ref_w"] = fw if fw is not None else row[f"{phase}_counter_w"]
        # the request's whole window as the proxy sees it: sent upstream to last byte
        a, b = r["t_send"], r["t_end"]
        row["request_counter_j"] = counter.between(a, b)
        per_req.append(row)
    res["reference_per_request"] = per_req
    for phase in ("prefill", "decode"):
        for key, col in (("reference_mean_w", "ref_w"), ("counter_window_mean_w", "counter_w")):
            vals = [row[f"{phase}_{col}"] for row in per_req]
            ok = vals and all(v is not None for v in vals)
            pw_phase[phase][key] = statistics.fmean(vals) if ok else None
        pw_phase[phase]["reference"] = (
            "schedule fit to the energy counter" if "error" not in fit else "counter window"
        )
        pw_phase[phase]["error_pct"] = _pct(
            pw_phase[phase]["mean_w"], pw_phase[phase]["reference_mean_w"]
        )
    # any energy family with a phase label (per-phase energy, idle energy): its delta by
    # phase, against the counter's energy over the requests' phase windows
    phase_energy: dict[str, Any] = {}
    for (n, lab), v in d.items():
        labels = dict(lab)
        if (
            ("energy" in n or "joule" in n)
            and "phase" in labels
            and not n.endswith(("_bucket", "_count"))
        ):
            key = f"{n}{{phase={labels['phase']}}}"
            phase_energy.setdefault(key, {"phase": labels["phase"], "delta": 0.0})["delta"] += v
    for item in phase_energy.values():
        phase = item["phase"]
        if phase in ("prefill", "decode"):
            ref = sum(row[f"{phase}_ref_w"] * row[f"{phase}_duration_s"] for row in per_req)
            item["reference_counter_j"] = ref
            item["error_pct"] = _pct(item["delta"], ref)
    res["phasewatch_phase_energy"] = phase_energy or None
    # per request, from the access log's power fields (matched by the time each ended)
    access = out.get("log", {}).get("access_power_fields", [])
    if not any(k.endswith("_watts") or "energy" in k for a in access for k in a):
        access = []
        res["per_request_access_log"] = {"note": "phasewatch's access lines carry no power"}
    if access and per_req:
        cmp_rows = []
        used: set[int] = set()
        for ref in per_req:
            near = [
                (abs(a.get("ts", 0) - ref["wall_end"]), i)
                for i, a in enumerate(access)
                if i not in used and isinstance(a.get("ts"), int | float)
            ]
            if not near or min(near)[0] > 2.0:
                cmp_rows.append({"error": "no access-log line for this request"})
                continue
            i = min(near)[1]
            used.add(i)
            got = access[i]
            row: dict[str, Any] = {"request_id": got.get("request_id")}
            for phase in ("prefill", "decode"):
                w = got.get(f"{phase}_watts")
                row[f"{phase}_watts"] = w
                row[f"{phase}_err_pct"] = _pct(w, ref[f"{phase}_ref_w"]) if w is not None else None
            ej = got.get("energy_j")
            row["energy_j"] = ej
            row["energy_err_pct_vs_request_window"] = (
                _pct(ej, ref["request_counter_j"]) if ej is not None else None
            )
            cmp_rows.append(row)
        res["per_request_access_log"] = cmp_rows
        # the same mean over the requests phasewatch gave a figure (it may leave a phase
        # it cannot resolve without one)
        for phase in ("prefill", "decode"):
            pairs = [
                (row[f"{phase}_watts"], ref[f"{phase}_ref_w"])
                for row, ref in zip(cmp_rows, per_req)
                if row.get(f"{phase}_watts") is not None and ref[f"{phase}_ref_w"] is not None
            ]
            pw_phase[phase]["logged_requests"] = len(pairs)
            pw_phase[phase]["unlogged_requests"] = len(per_req) - len(pairs)
            if pairs:
                got = statistics.fmean(p[0] for p in pairs)
                ref_w = statistics.fmean(p[1] for p in pairs)
                pw_phase[phase]["logged_mean_w"] = got
                pw_phase[phase]["reference_mean_w_logged"] = ref_w
                pw_phase[phase]["logged_error_pct"] = _pct(got, ref_w)
    # energy totals over the scrape window
    window = out.get("scrape_window")
    if window:
        e = conservation(d, counter, window)
        e["phasewatch_request_energy_j_vs_request_windows"] = (
            sum(r["request_counter_j"] for r in per_req) if per_req else None
        )
        e["request_energy_err_pct"] = _pct(
            e["phasewatch_request_energy_j"], e["phasewatch_request_energy_j_vs_request_windows"]
        )
        e["timing_note"] = "scrapes are timed at the client: a few ms of slack at each end"
        res["energy"] = e
    return res


# --------------------------------------------------------------------------- main


#: phasewatch's field label values (its sensor gauges) -> this check's field names
_FIELD_NAMES = {
    "energy_counter": "counter_w",
    "power_instant": "instant_w",
    "power_usage": "usage_w",
    "power_average": "average_w",
}


def learned_vs_measured(data: dict) -> dict | None:
    """What phasewatch says about the sensor (any gauge with a field label and "refresh"
    in its name, and any sensor/resolution gauge) beside what the 1 ms poll measured."""
    after = (data.get("phasewatch") or {}).get("metrics_after") or []
    fields = (data.get("square") or {}).get("fields") or {}
    out: dict[str, Any] = {"refresh": {}, "other": []}
    for m in after:
        name, labels, value = m["name"], m["labels"], m["value"]
        if "refresh" in name and "field" in labels:
            mine = fields.get(_FIELD_NAMES.get(labels["field"], labels["field"]), {})
            measured = mine.get("refresh_period_s")
            out["refresh"][labels["field"]] = {
                "phasewatch_s": value,
                "measured_s": measured,
                "diff_pct": _pct(value, measured),
            }
        elif re.search(r"sensor|resolution", name):
            out["other"].append(m)
    return out if out["refresh"] or out["other"] else None


def environment(dry_run: bool, env: dict) -> dict:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "dry_run": dry_run,
        "repo_root": str(ROOT),
    }
    with contextlib.suppress(Exception):
        info["git_head"] = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, proxy, pynvml; import importlib.metadata as m\n"
            "v = {}\n"
            "for p in ('fastapi', 'uvicorn', 'pydantic', 'prometheus-client', 'nvidia-ml-py', 'httptools'):\n"
            "    try: v[p] = m.version(p)\n"
            "    except Exception as e: v[p] = None\n"
            "print(json.dumps({'proxy': proxy.__file__, 'pynvml': pynvml.__file__, 'versions': v}))",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode == 0:
        info["phasewatch_import"] = json.loads(probe.stdout.strip().splitlines()[-1])
        info["phasewatch_from_this_tree"] = info["phasewatch_import"]["proxy"].startswith(str(ROOT))
    else:
        info["phasewatch_import_error"] = probe.stderr[-2000:]
    return info


def gpu_info(nvml: Any, gpu: int) -> dict:
    info: dict[str, Any] = {}
    h = nvml.nvmlDeviceGetHandleByIndex(gpu)
    for key, fn in (
        ("name", lambda: nvml.nvmlDeviceGetName(h)),
        ("driver", lambda: nvml.nvmlSystemGetDriverVersion()),
        ("power_limit_w", lambda: nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
        ("gpu_count", lambda: nvml.nvmlDeviceGetCount()),
        ("architecture", lambda: nvml.nvmlDeviceGetArchitecture(h)),
        ("cuda_capability", lambda: nvml.nvmlDeviceGetCudaComputeCapability(h)),
    ):
        try:
            v = fn()
            info[key] = v.decode() if isinstance(v, bytes) else v
        except Exception as exc:
            info[key] = None
            info[f"{key}_error"] = f"{type(exc).__name__}: {exc}"
    return info


def summary_lines(data: dict) -> list[str]:
    lines = [f"gpu_power_check: {data.get('status')}"]
    env = data.get("env", {})
    g = data.get("gpu", {})
    lines.append(
        f"  GPU {g.get('name')} driver {g.get('driver')}  torch {env.get('torch')}  dry_run={env.get('dry_run')}"
    )
    sq = data.get("square", {})
    if "error" in sq:
        lines.append(f"  square wave: FAILED {sq['error'][:200]}")
    for name, f in (sq.get("fields") or {}).items():
        lag = f.get("lag", {}).get("compute", {})
        lines.append(
            f"  {name:10s} refresh {_fmt(f.get('refresh_period_s'), 's')}  rise50 {_fmt(lag.get('rise_to_50pct_s'), 's')}"
            f"  rise90 {_fmt(lag.get('rise_to_90pct_s'), 's')}  fall50 {_fmt(lag.get('fall_to_50pct_s'), 's')}"
        )
    poll = sq.get("poll") or {}
    if poll:
        every = poll.get("poll_interval_median_s") or {}
        lines.append(
            "  poll every (call takes): "
            + "  ".join(
                f"{k} {_fmt(every.get(k), 's')} ({_fmt(v, 's')})"
                for k, v in (poll.get("call_median_s") or {}).items()
                if v is not None
            )
        )
    for name, v in (sq.get("pulse_visibility") or {}).items():
        if isinstance(v, dict) and "seen_fraction" in v:
            w = v.get("window_estimate_s")
            wp = v.get("window_from_peak_s")
            lines.append(
                f"  {name:10s} sees {v['seen_fraction']:.0%} of {PULSE_S * 1000:.0f} ms pulses"
                + (f" (window ~{_fmt(w, 's')} from that share" if w is not None else "")
                + (
                    f", {_fmt(wp, 's') if isinstance(wp, float) else wp} from peaks)"
                    if w is not None and wp is not None
                    else ")"
                    if w is not None
                    else ""
                )
            )
    for name, err in (sq.get("poll", {}).get("errors") or {}).items():
        lines.append(f"  unsupported {name}: {err}")
    for key, s in ((sq.get("energy") or {}).get("summary") or {}).items():
        errs = "  ".join(
            f"{k.replace('integral_', '')} {_fmt(v, '%')}" for k, v in s["median_err_pct"].items()
        )
        lines.append(
            f"  burst {key:13s} {_fmt(s['truth_mean_w'], 'W')} (fit {_fmt(s.get('fit_mean_w'), 'W')})"
            f"  window energy err: {errs}"
        )
    pw = data.get("phasewatch", {})
    if "error" in pw:
        lines.append(f"  phasewatch: FAILED {pw['error'][:200]}")
    for phase, p in (pw.get("phasewatch_phase_power") or {}).items():
        lines.append(
            f"  phasewatch {phase:7s} {_fmt(p.get('mean_w'), 'W')} (n={_fmt(p.get('observations'), '')}) vs truth "
            f"{_fmt(p.get('reference_mean_w'), 'W')}: {_fmt(p.get('error_pct'), '%')}"
            + (
                f"; per logged request {_fmt(p.get('logged_error_pct'), '%')},"
                f" {p.get('unlogged_requests')} without a figure"
                if p.get("logged_requests")
                else ""
            )
        )
    e = pw.get("energy") or {}
    if e:
        lines.append(
            f"  phasewatch energy: gpu {_fmt(e.get('gpu_energy_err_pct'), '%')}  requests {_fmt(e.get('request_energy_err_pct'), '%')}"
        )
    if e:
        lines.append(
            f"  attributed+idle vs phasewatch gpu energy: {_fmt(e.get('attributed_plus_idle_vs_gpu_pct'), '%')}"
            + (f" ({e['note']})" if e.get("note") else "")
        )
    ce = (pw.get("concurrent") or {}).get("energy") or {}
    if ce:
        lines.append(
            f"  2 concurrent: gpu energy {_fmt(ce.get('gpu_energy_err_pct'), '%')}, attributed+idle"
            f" vs gpu {_fmt(ce.get('attributed_plus_idle_vs_gpu_pct'), '%')}"
        )
    if pw.get("phasewatch_unresolved_delta"):
        lines.append(f"  unresolved: {pw['phasewatch_unresolved_delta']}")
    for fld, v in ((data.get("learned_vs_measured") or {}).get("refresh") or {}).items():
        lines.append(
            f"  phasewatch learnt {fld} refresh {_fmt(v.get('phasewatch_s'), 's')}"
            f" (measured {_fmt(v.get('measured_s'), 's')})"
        )
    lines.append(f"  wall {_fmt(data.get('wall_s'), 's')}")
    return lines


def _fmt(v: Any, unit: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if unit == "%":
        return f"{v:+.1f}%"
    if unit == "s":
        if abs(v) < 0.01:
            return f"{v * 1e6:.0f}us"
        return f"{v * 1000:.0f}ms" if abs(v) < 1 else f"{v:.2f}s"
    return f"{v:.0f}{unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--dry-run", action="store_true", help="fake NVML, CPU torch or sleeps")
    ap.add_argument("--quick", action="store_true", help="a short schedule (tests)")
    ap.add_argument("--gpu", type=int, default=0, help="NVML index of the GPU to watch")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--skip", action="append", default=[], choices=["square", "phasewatch"])
    ap.add_argument(
        "--phasewatch-arg", action="append", default=[], help="extra serve flag (repeat)"
    )
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + args.budget
    report = Report(Path(args.out))
    data = report.data
    workdir = Path(tempfile.mkdtemp(prefix="gpu_power_check_"))
    env = dict(os.environ)
    path = [str(ROOT), *([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])]
    activity = None
    if args.dry_run:
        activity = workdir / "activity.txt"
        activity.touch()
        env["FAKE_NVML_ACTIVITY"] = str(activity)
        os.environ["FAKE_NVML_ACTIVITY"] = str(activity)
        path.insert(0, str(FAKE_NVML))
        sys.path.insert(0, str(FAKE_NVML))
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PYTHONUNBUFFERED"] = "1"

    def watchdog() -> None:
        data["status"] = "watchdog: over budget"
        data["wall_s"] = time.monotonic() - t_start
        with contextlib.suppress(Exception):
            report.write()
        print("\n".join(summary_lines(data)), flush=True)
        os._exit(3)

    dog = threading.Timer(args.budget + 45, watchdog)
    dog.daemon = True
    dog.start()
    failed = False
    try:
        data["env"] = _clean(environment(args.dry_run, env))
    except Exception as exc:
        data["env"] = {"error": f"{type(exc).__name__}: {exc}"}
    # the device: torch/CUDA for the load, NVML for the sensors
    mode = "sleep"
    reason = None
    try:
        import torch

        data["env"]["torch"] = torch.__version__
        if args.dry_run:
            mode = "cpu-torch"
        elif torch.cuda.is_available():
            mode = "cuda"
            torch.cuda.set_device(0)
            data["env"]["cuda_device"] = torch.cuda.get_device_name(0)
        else:
            reason = "torch sees no CUDA device"
    except Exception as exc:
        data["env"]["torch"] = None
        if not args.dry_run:
            reason = f"torch not importable ({type(exc).__name__}: {exc})"
    try:
        import pynvml

        pynvml.nvmlInit()
        data["gpu"] = _clean(gpu_info(pynvml, args.gpu))
        data["gpu"]["pynvml"] = getattr(pynvml, "__file__", None)
    except Exception as exc:
        reason = reason or f"NVML not available ({type(exc).__name__}: {exc})"
    if reason and not args.dry_run:
        data["status"] = "no GPU"
        data["reason"] = reason
        data["wall_s"] = time.monotonic() - t_start
        report.write()
        print("\n".join(summary_lines(data)))
        print(f"  {reason}")
        return 2
    load = Load(mode, activity)
    try:
        load.setup()
        if mode != "sleep":  # warm the clocks and kernels, then let the sensor settle
            load.burst("compute", 1.0 if not args.quick else 0.2)
            load.burst("memory", 1.0 if not args.quick else 0.2)
            time.sleep(1.5 if not args.quick else 0.3)
    except Exception as exc:
        data["load_error"] = f"{type(exc).__name__}: {exc}"
        load = Load("sleep", activity)
    data["load"] = _clean(load.info)
    report.write()
    # section time boxes: the square wave gets up to 45 % of what is left
    sections = [s for s in ("square", "phasewatch") if s not in args.skip]
    traces: dict[str, Any] = {}
    out_path = Path(args.out)
    trace_path = out_path.with_name(out_path.stem + "_trace.json.gz")
    for name in sections:
        t0 = time.monotonic()
        left = deadline - t0
        box = t0 + (left * 0.45 if name == "square" and "phasewatch" in sections else left - 5)
        try:
            if name == "square":
                res = run_square(load, workdir, env, args.gpu, args.quick, box)
            else:
                res = run_phasewatch(
                    load, workdir, env, args.gpu, args.quick, box, args.phasewatch_arg
                )
            traces[name] = res.pop("trace", None)
            data[name] = _clean(res)
            failed = failed or "error" in res
        except Exception as exc:
            failed = True
            data[name] = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }
        data[name]["section_s"] = time.monotonic() - t0
        report.write()
        with contextlib.suppress(Exception):
            with gzip.open(trace_path, "wt", encoding="utf-8") as f:
                json.dump(_clean(traces), f)
            data["trace_file"] = trace_path.name
    with contextlib.suppress(Exception):
        data["learned_vs_measured"] = learned_vs_measured(data)
    data["status"] = "partial" if failed else "ok"
    data["wall_s"] = time.monotonic() - t_start
    data["workdir"] = str(workdir)
    lines = summary_lines(data)
    data["summary"] = lines
    report.write()
    dog.cancel()
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
