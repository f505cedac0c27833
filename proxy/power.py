"""GPU power (SPEC §3): where it is read, the sampler thread, energy, per-request phase power.

A side service. Sources (NVML on this host, a DCGM-exporter endpoint for a GPU on another
host) sit behind one small interface; a daemon thread samples them off the event loop, with
every driver or HTTP call behind a timeout on a second daemon thread, so a hung NVML call
can neither stall the proxy nor keep it from exiting. Each sample is classified by what the
GPU's upstream had in flight (idle / prefill / decode), counted as energy (the device's own
energy counter where it has one, else integrated power) and kept in a short ring, from which
the recorder's listener computes each request's mean power over its prefill and decode
windows and its share of the energy.

When power cannot be read, everything else goes on: power series go stale or absent (never
zero), ``phasewatch_power_sampling_up`` is 0, and one log line says why.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import importlib
import logging
import queue
import re
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import httpx

from .metrics import Metrics

log = logging.getLogger("phasewatch")

#: No GPU draws more than this (W): bounds what an energy-counter jump may mean.
MAX_GPU_WATTS = 5000.0
#: Longest gap (s) bridged by integrating power between two samples; beyond it the energy
#: of the gap is unknown and not made up (an energy counter still covers it).
MAX_INTEGRATION_GAP = 30.0
#: How long samples are kept for per-request windows (s): longer than most generations.
RING_SECONDS = 1800.0


class PowerUnavailable(Exception):
    """Power cannot be read from this source at all (no library, no GPU)."""


@dataclass(slots=True)
class Reading:
    """One GPU at one moment."""

    watts: float
    energy_mj: int | None = None  # the device's cumulative energy counter, if it has one


class Source(Protocol):
    name: str

    def open(self) -> None: ...
    def read(self) -> dict[str, Reading]: ...
    def close(self) -> None: ...


# --- sources ----------------------------------------------------------------------------


def _import_pynvml():
    with warnings.catch_warnings():  # the pynvml shim warns on import; nothing to act on here
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module("pynvml")
        except ImportError as exc:
            raise PowerUnavailable(f"pynvml is not installed ({exc})") from None


class NvmlSource:
    """This host's GPUs through NVML (pynvml): power in mW, energy counter in mJ (Volta+).

    GPUs are numbered as NVML numbers them (as nvidia-smi shows), which need not match
    CUDA_VISIBLE_DEVICES inside an engine's container.
    """

    name = "nvml"

    def __init__(self) -> None:
        self.nvml = None
        self.handles: dict[str, object] = {}
        self.has_counter: dict[str, bool] = {}

    def open(self) -> None:
        nvml = _import_pynvml()
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            handles = {str(i): nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)}
        except nvml.NVMLError as exc:
            raise PowerUnavailable(f"NVML is not available ({exc})") from None
        if not handles:
            raise PowerUnavailable("NVML sees no GPU")
        self.nvml, self.handles = nvml, handles
        for gpu, h in handles.items():
            try:
                nvml.nvmlDeviceGetTotalEnergyConsumption(h)
                self.has_counter[gpu] = True
            except nvml.NVMLError:  # pre-Volta or not exposed: integrate power instead
                self.has_counter[gpu] = False

    def read(self) -> dict[str, Reading]:
        nvml = self.nvml
        out = {}
        for gpu, h in self.handles.items():
            watts = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0  # an NVMLError fails the tick
            energy = None
            if self.has_counter[gpu]:
                try:
                    energy = int(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
                except nvml.NVMLError:
                    energy = None  # this interval is integrated instead
            out[gpu] = Reading(watts, energy)
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass


_DCGM_LINE = re.compile(
    r"^(DCGM_FI_DEV_POWER_USAGE|DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION)\{([^}]*)\}\s+(\S+)",
    re.MULTILINE)
_GPU_LABEL = re.compile(r'(?:^|,)\s*gpu="([^"]*)"')


def parse_dcgm(text: str) -> dict[str, Reading]:
    """Power (W) and energy (mJ) per `gpu` label from a DCGM-exporter /metrics page.

    Other families (vLLM's, the exporter's other fields) are skipped without parsing. MIG
    instances repeat a GPU's device-level values; the first line per GPU wins.
    """
    power: dict[str, float] = {}
    energy: dict[str, int] = {}
    for m in _DCGM_LINE.finditer(text):
        g = _GPU_LABEL.search(m.group(2))
        if g is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if value != value or value < 0:  # NaN or nonsense
            continue
        if m.group(1) == "DCGM_FI_DEV_POWER_USAGE":
            power.setdefault(g.group(1), value)
        else:
            energy.setdefault(g.group(1), int(value))
    return {gpu: Reading(w, energy.get(gpu)) for gpu, w in power.items()}


class DcgmSource:
    """A DCGM-exporter (or the simulator's) /metrics endpoint, for GPUs on another host.

    dcgm-exporter refreshes its fields every 30 s by default; for per-request power run it
    with a short collect interval (``-c 200``).
    """

    name = "dcgm"

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.client = httpx.Client(timeout=timeout, trust_env=False)

    def open(self) -> None:
        pass  # the endpoint may be down at start: each read tries again

    def read(self) -> dict[str, Reading]:
        resp = self.client.get(self.url)
        if resp.status_code != 200:
            raise RuntimeError(f"{self.url} answered {resp.status_code}")
        readings = parse_dcgm(resp.text)
        if not readings:
            raise RuntimeError(f"no DCGM_FI_DEV_POWER_USAGE with a gpu label at {self.url}")
        return readings

    def close(self) -> None:
        self.client.close()


# --- pure pieces: energy steps, integration ----------------------------------------------


class EnergyMeter:
    """Energy of one GPU between successive readings, in joules.

    Uses the counter's increase where the counter is present on both readings; across a
    decrease it tries a 32- or 64-bit wrap (when that gives a plausible increase), else
    takes it for a reset (driver reload) and integrates power for that interval.
    """

    __slots__ = ("t", "watts", "counter")

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
                    delta = next((m - self.counter + counter for m in (1 << 32, 1 << 64)
                                  if self.counter < m and 0 <= m - self.counter + counter
                                  <= MAX_GPU_WATTS * 1000.0 * dt), None)
            if delta is not None:
                joules = delta / 1000.0
            elif dt <= MAX_INTEGRATION_GAP:
                joules = (self.watts + watts) / 2.0 * dt
        self.t, self.watts, self.counter = t, watts, counter
        return joules


def integrate(ts: list[float], ys: list[float], a: float, b: float) -> float:
    """Integral over [a, b] of the line through the samples (ts ascending), held flat
    beyond the first and last sample."""
    if b <= a or not ts:
        return 0.0

    def at(t: float) -> float:
        i = bisect.bisect_right(ts, t)
        if i == 0:
            return ys[0]
        if i == len(ts):
            return ys[-1]
        t0, t1 = ts[i - 1], ts[i]
        return ys[i] if t1 <= t0 else ys[i - 1] + (ys[i] - ys[i - 1]) * (t - t0) / (t1 - t0)

    lo, hi = bisect.bisect_right(ts, a), bisect.bisect_left(ts, b)
    total, pt, py = 0.0, a, at(a)
    for k in range(lo, hi):
        total += (py + ys[k]) / 2.0 * (ts[k] - pt)
        pt, py = ts[k], ys[k]
    return total + (py + at(b)) / 2.0 * (b - pt)


class Ring:
    """Recent samples of one GPU: time, watts, requests in flight. Appended by the sampler
    thread, read by the recorder's listener on the event loop (short critical sections)."""

    def __init__(self, keep_seconds: float = RING_SECONDS) -> None:
        self.keep = keep_seconds
        self.lock = threading.Lock()
        self.t: list[float] = []
        self.w: list[float] = []
        self.n: list[int] = []

    def append(self, t: float, watts: float, in_flight: int) -> None:
        with self.lock:
            self.t.append(t)
            self.w.append(watts)
            self.n.append(in_flight)
            if len(self.t) % 1024 == 0 and self.t[0] < t - self.keep:
                k = bisect.bisect_left(self.t, t - self.keep)
                del self.t[:k], self.w[:k], self.n[:k]

    def window(self, a: float, b: float) -> tuple[list[float], list[float], list[int], int]:
        """The samples covering [a, b] (one beyond each end) and how many lie inside."""
        with self.lock:
            lo = max(0, bisect.bisect_left(self.t, a) - 1)
            hi = bisect.bisect_right(self.t, b) + 1
            inside = bisect.bisect_right(self.t, b) - bisect.bisect_left(self.t, a)
            return self.t[lo:hi], self.w[lo:hi], self.n[lo:hi], inside


# --- which GPU serves what ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Owner:
    upstream: object  # proxy.upstreams.Upstream (duck-typed: name, active, models, precision_of)
    model: str | None  # None: the whole upstream


class GpuMap:
    """GPU -> the upstream(s) or model it serves, from ``--power-gpu GPU=UPSTREAM|MODEL``;
    with no mapping every GPU serves every upstream."""

    def __init__(self, pairs: dict[str, str], upstreams: list, route: Callable[[str], object]):
        self.pairs = pairs
        self.upstreams = upstreams
        self.route = route
        self._owners: dict[str, tuple[Owner, ...]] = {}

    def owners(self, gpu: str) -> tuple[Owner, ...]:
        """Who this GPU works for; empty when a mapping is given and leaves it out."""
        found = self._owners.get(gpu)
        if found is None:
            if not self.pairs:
                found = tuple(Owner(u, None) for u in self.upstreams)
            elif gpu not in self.pairs:
                found = ()
            else:
                target = self.pairs[gpu]
                by_name = [u for u in self.upstreams if u.name == target]
                found = (Owner(by_name[0], None),) if by_name else (Owner(self.route(target), target),)
            self._owners[gpu] = found
        return found

    def labels(self, gpu: str) -> tuple[str, str, str]:
        """(upstream, model, precision) for this GPU's series. A GPU shared by several
        upstreams is labelled with their names joined by '+'; one serving several models
        has model ``all`` and their common precision, or ``mixed``."""
        owners = self.owners(gpu)
        upstream = "+".join(sorted({o.upstream.name for o in owners}))
        models: dict[tuple[str, str | None], object] = {}  # (upstream name, model) -> upstream
        for o in owners:
            listed = [o.model] if o.model is not None else sorted(
                o.upstream.models | o.upstream.configured_models) or [None]
            models.update(((o.upstream.name, m), o.upstream) for m in listed)
        if len(models) == 1:
            (_, model), up = next(iter(models.items()))
            if model is not None:
                return upstream, model, up.precision_of(model).precision
        precisions = {up.precision_of(m).precision if m else "unknown"
                      for (_, m), up in models.items()}
        return upstream, "all", precisions.pop() if len(precisions) == 1 else "mixed"

    def in_flight(self, gpu: str) -> list:
        out = []
        for o in self.owners(gpu):
            try:
                active = list(o.upstream.active)
            except RuntimeError:  # changed while copied: take the next tick's view
                active = []
            out.extend(active if o.model is None else [ex for ex in active if ex.model_label == o.model])
        return out

    def serves(self, gpu: str, ex) -> bool:
        return any(o.upstream is ex.upstream and (o.model is None or o.model == ex.model_label)
                   for o in self.owners(gpu))


def classify(in_flight: Iterable) -> str:
    """idle / prefill / decode for what a GPU's upstream has in flight. Any request before
    its first token makes it prefill (the engine runs that prompt now); a non-streamed
    request shows no first token, and counts as decode, where it spends most of its time."""
    state = "idle"
    for ex in in_flight:
        if ex.marks.t_first is None and ex.prepared.stream:
            return "prefill"
        state = "decode"
    return state


# --- the sampler -------------------------------------------------------------------------------


class _Caller:
    """Runs source calls on one daemon thread, so a call that hangs in the driver costs a
    timeout, not the sampler (and never blocks interpreter exit)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.busy: concurrent.futures.Future | None = None
        threading.Thread(target=self._run, name="phasewatch-power-call", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    def call(self, fn, timeout: float):
        """fn() or raises; TimeoutError while a previous call is still hung."""
        if self.busy is not None and not self.busy.done():
            raise TimeoutError("a previous call has not returned yet")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.busy = fut
        self.jobs.put((fn, fut))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {timeout:g}s") from None


class PowerSampler:
    """Samples a source, feeds the power metrics and the per-GPU rings.

    :meth:`tick` does one sample; :meth:`start` runs it every `interval` on a daemon thread.
    Tests drive :meth:`tick` with their own clock.
    """

    def __init__(self, source: Source, metrics: Metrics, gpus: GpuMap, *, interval: float,
                 timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.metrics = metrics
        self.gpus = gpus
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self.rings: dict[str, Ring] = {}
        self.meters: dict[str, EnergyMeter] = {}
        self.up: bool | None = None  # None until the first tick
        self.opened = False
        self._current: dict[str, tuple] = {}  # gpu -> labels of its current-watts gauge
        self._caller = _Caller()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._up_gauge = metrics.power_sampling_up.labels(source.name)

    # --- lifecycle ---------------------------------------------------------------------

    def open(self) -> bool:
        """Open the source; False (said once) when power cannot be read here at all."""
        try:  # nvmlInit can take seconds on a many-GPU host without persistence mode
            self._caller.call(self.source.open, max(30.0, self.timeout))
        except PowerUnavailable as exc:
            self._set_down(str(exc), permanent=True)
            return False
        except Exception as exc:  # noqa: BLE001 - a hang or a driver error
            self._set_down(f"opening {self.source.name} failed: {exc}", permanent=True)
            return False
        self.opened = True
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="phasewatch-power", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.timeout + self.interval)
        if self.opened:
            try:
                self._caller.call(self.source.close, 1.0)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass

    def _run(self) -> None:
        if not self.open():
            return
        next_t = time.monotonic()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the sampler must outlive its bugs
                log.exception("power sampler tick failed")
            next_t += self.interval
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (a hang): skip the missed ticks
                next_t, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # --- one sample -----------------------------------------------------------------------

    def tick(self) -> None:
        t0 = self.clock()
        try:
            readings = self._caller.call(self.source.read, self.timeout)
        except TimeoutError as exc:
            self._set_down(f"a call to {self.source.name} hung ({exc})")
            return
        except Exception as exc:  # noqa: BLE001 - driver or HTTP error: said once
            self._set_down(f"reading {self.source.name} failed: {exc}")
            return
        t = (t0 + self.clock()) / 2.0
        m = self.metrics
        seen = 0
        for gpu, r in sorted(readings.items()):
            if not self.gpus.owners(gpu):
                continue
            seen += 1
            labels = self.gpus.labels(gpu)
            in_flight = self.gpus.in_flight(gpu)
            m.gpu_power_sample_watts.labels(*labels, gpu, classify(in_flight)).observe(r.watts)
            current = labels + (gpu,)
            old = self._current.get(gpu)
            if old is not None and old != current:
                _remove(m.gpu_power_current_watts, old)
            m.gpu_power_current_watts.labels(*current).set(r.watts)
            self._current[gpu] = current
            joules = self.meters.setdefault(gpu, EnergyMeter()).step(t, r.watts, r.energy_mj)
            if joules > 0:
                m.gpu_energy_joules_total.labels(*current).inc(joules)
            self.rings.setdefault(gpu, Ring()).append(t, r.watts, len(in_flight))
        if seen:
            self._set_up(len(readings), seen)
        else:
            self._set_down(f"{self.source.name} reports GPUs {sorted(readings)}, none of them "
                           "mapped by --power-gpu")

    def _set_up(self, visible: int, used: int) -> None:
        if self.up is None:
            log.info("GPU power sampled from %s every %gs: %d of %d GPUs", self.source.name,
                     self.interval, used, visible)
        elif self.up is False:
            log.info("GPU power sampling from %s resumed", self.source.name)
        self.up = True
        self._up_gauge.set(1)

    def _set_down(self, why: str, permanent: bool = False) -> None:
        if self.up is not False:
            if permanent:
                log.info("GPU power is not sampled: %s. Requests are relayed and measured as "
                         "usual; for a GPU on another host use --power-source dcgm "
                         "--power-dcgm-url URL", why)
            else:
                log.warning("GPU power is not being sampled: %s. Requests are still relayed "
                            "and measured; power metrics stay stale until it recovers", why)
        self.up = False
        self._up_gauge.set(0)
        for labels in self._current.values():
            _remove(self.metrics.gpu_power_current_watts, labels)
        self._current.clear()

    # --- per request ------------------------------------------------------------------------

    def request_power(self, ex, completion_tokens: int | None) -> dict:
        """Mean watts over the request's prefill and decode windows (its GPUs summed) and its
        share of their energy (split evenly among the requests in flight on them)."""
        rings = [ring for gpu, ring in list(self.rings.items()) if self.gpus.serves(gpu, ex)]
        mk = ex.marks
        if not rings or mk.t_sent is None:
            return {}
        out: dict = {}
        for phase, a, b in (("prefill", mk.t_sent, mk.t_first), ("decode", mk.t_first, mk.t_last)):
            if a is None or b is None or b <= a:
                continue
            total, inside = 0.0, 0
            for ring in rings:
                ts, ws, _, k = ring.window(a, b)
                total += integrate(ts, ws, a, b)
                inside = max(inside, k)
            if inside:  # a window between two samples has no measurement of its own
                out[phase] = total / (b - a)
        end = mk.t_last if mk.t_last is not None else mk.t_end
        if end is not None and end > mk.t_sent:
            joules, inside = 0.0, 0
            for ring in rings:
                ts, ws, ns, k = ring.window(mk.t_sent, end)
                joules += integrate(ts, [w / max(1, n) for w, n in zip(ws, ns)], mk.t_sent, end)
                inside = max(inside, k)
            if inside:
                out["energy"] = joules
                if completion_tokens:
                    out["joules_per_token"] = joules / completion_tokens
        return out


def _remove(metric, labels: tuple) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass


# --- wiring -------------------------------------------------------------------------------------


class PowerService:
    """The power side service as the app sees it: start, stop, and a recorder listener."""

    def __init__(self, settings, metrics: Metrics, upstreams) -> None:
        self.metrics = metrics
        self.sampler: PowerSampler | None = None
        source = _choose_source(settings)
        if source is None:
            metrics.power_sampling_up.labels("none").set(0)
            log.info("GPU power is not sampled (--power-source none)")
            return
        gpus = GpuMap(settings.power_gpu_map(), upstreams.all, upstreams.route)
        self.sampler = PowerSampler(source, metrics, gpus, interval=settings.power_interval,
                                    timeout=max(1.0, 4 * settings.power_interval))

    def start(self) -> None:
        if self.sampler is not None:
            self.sampler.start()

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def on_request(self, ex, f) -> dict | None:
        """Recorder listener: observes per-phase power and returns the log-line fields."""
        if self.sampler is None or not self.sampler.rings:
            return None
        got = self.sampler.request_power(ex, f.completion_tokens)
        if not got:
            return None
        up = ex.upstream
        base = (up.name, ex.model_label, up.precision_of(ex.model_label).precision)
        fields: dict = {}
        for phase in ("prefill", "decode"):
            if phase in got:
                self.metrics.gpu_power_watts.labels(*base, phase).observe(got[phase])
                fields[f"{phase}_watts"] = round(got[phase], 1)
        if "energy" in got:
            fields["energy_j"] = round(got["energy"], 3)
        if "joules_per_token" in got:
            fields["joules_per_token"] = round(got["joules_per_token"], 4)
        return fields


def _choose_source(settings) -> Source | None:
    """auto: DCGM when a URL is given, else NVML (which says once if it is not there)."""
    kind = settings.power_source
    if kind == "auto":
        kind = "dcgm" if settings.power_dcgm_url else "nvml"
    if kind == "none":
        return None
    if kind == "dcgm":
        if not settings.power_dcgm_url:
            raise ValueError("--power-source dcgm needs --power-dcgm-url "
                             "(e.g. http://gpu-host:9400/metrics)")
        return DcgmSource(settings.power_dcgm_url, timeout=max(1.0, 4 * settings.power_interval))
    return NvmlSource()
