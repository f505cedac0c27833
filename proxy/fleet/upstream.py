"""Upstream engines: where a request goes, its engine, its admission gate, its models.

One pooled keep-alive client per upstream. The engine is detected in the background
(at start and whenever the upstream comes back, since it may have been replaced) unless
the operator named it. The model list is refreshed in the background and bounds the
`model` label: names the upstream does not list (or the operator did not configure) are
labelled ``other``. Routing reads the whole list (a client that makes an engine list many
models cannot push a real one out of it); labels take the first ``--max-models`` names and
keep them while they are listed.

Health: a refused connection or a failed request ejects the upstream at once (it is
``down`` with its reason); an idle upstream is probed every ``--health-interval`` with one
cheap GET (not while real traffic answers), and a down one is probed back with a backoff
that starts at a quarter second and doubles up to ``--health-backoff-max``, jittered. All
upstreams together, routing among them and the loops that refresh and probe each:
:mod:`.fleet`.

Failure is judged by real requests, not by heads or probes: a request succeeds when its
whole answer arrived under 400 (:meth:`Upstream.succeeded`); 5xx answers, read timeouts
and answers cut short count as failures in a row (``--eject-after-5xx`` of them eject).
An upstream that came back after an ejection is on trial (half-open): a pool lets one
real request through to it at a time until one succeeds; one that fails ejects it again,
for longer. A 429 holds the upstream back from its pool for its ``Retry-After`` (at most
:data:`MAX_HOLD` s; 1 s without one): a fast refusal is load, not speed.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import functools
import logging
import math
import random
import time
from dataclasses import astuple, dataclass, field, replace
from typing import Any

import httpx

from ..engines import GENERIC, Dialect, ModelQuery, detect_engine, get_dialect
from ..measure.kvcache import KVModel, KVShape
from ..measure.metrics import Metrics
from ..measure.precision import Precision, PrecisionTable
from ..measure.summary import model_family
from ..transport import ClientOptions, LeanTransport, TLSOptions, make_client, make_transport
from .gate import AdmissionGate

log = logging.getLogger(__name__)

OTHER = "other"
#: The engine label until detection has answered.
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream as the operator configured it."""

    name: str
    url: str  # base URL, a base path included (http://host:8000/tenant-a)
    engine: str | None = None  # the operator's override; None: detected
    api_key: str | None = field(default=None, repr=False)  # sent as Authorization: Bearer
    tls: TLSOptions | None = None  # this upstream's own TLS options (default: the shared ones)
    weight: float = 1.0  # its share in a pool (--upstream-weight)


@dataclass(frozen=True, slots=True)
class UpstreamOptions:
    """What every upstream shares: its client, its gate, how its models are listed."""

    client: ClientOptions = field(default_factory=ClientOptions)
    max_concurrency: int = 0
    max_queue: int = 256
    queue_timeout: float = 0.0
    max_models: int = 64
    models: frozenset[str] = frozenset()
    precision: tuple[tuple[str, str], ...] = ()
    model_dir: str | None = None
    #: KV-cache element type per model or upstream name (``fp8``, ``q8_0`` ...), for
    #: engines that do not say (llama-server's --cache-type-k, OLLAMA_KV_CACHE_TYPE)
    kv_cache_dtype: tuple[tuple[str, str], ...] = ()
    #: Seconds between health probes of an idle upstream that is up (0: no probes).
    health_interval: float = 1.0
    #: Longest wait between probes of a down (ejected) upstream.
    health_backoff_max: float = 2.0
    #: Longest hold of an upstream whose probe answers but whose real requests fail
    #: again on trial: each such ejection doubles the hold, up to this.
    eject_backoff_max: float = 30.0
    #: Seconds one health probe may take.
    health_timeout: float = 2.0
    #: 5xx answers in a row that eject an upstream (0: never on status alone).
    eject_after_5xx: int = 3


#: The backoff of a down upstream's probes starts here and doubles.
BACKOFF_START = 0.25
#: Longest a 429's Retry-After holds an upstream back from its pool, and the hold
#: without one.
MAX_HOLD = 60.0
DEFAULT_HOLD = 1.0
#: Longest one trial request (half-open) keeps other requests from an upstream on trial.
TRIAL_WAIT = 10.0
#: Weight of the newest request in the measured seconds per request.
SERVICE_ALPHA = 0.2


def retry_seconds(value: str | None) -> float:
    """A Retry-After value in seconds, within 0..MAX_HOLD: delta-seconds or an HTTP date;
    DEFAULT_HOLD when missing or unreadable."""
    if not value:
        return DEFAULT_HOLD
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_HOLD)
    try:
        when = email.utils.parsedate_to_datetime(value[:64])
    except (TypeError, ValueError, IndexError):
        return DEFAULT_HOLD
    if when.tzinfo is None:
        return DEFAULT_HOLD
    return min(max(when.timestamp() - time.time(), 0.0), MAX_HOLD)


def failure_reason(exc: BaseException, path: str) -> str:
    """A short reason an upstream is down, for the status page (no wire text)."""
    if isinstance(exc, httpx.ConnectTimeout):
        return "connect timeout"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer on {path} in time"
    text = str(exc).lower()
    if "refused" in text or f"[errno {errno.ECONNREFUSED}]" in text:
        return "connection refused"
    if isinstance(exc, httpx.ConnectError):
        return "connect error"
    return f"{type(exc).__name__} on {path}"


class Upstream:
    """One engine behind the proxy."""

    def __init__(self, spec: UpstreamSpec, options: UpstreamOptions, metrics: Metrics) -> None:
        self.spec = spec
        self.name = spec.name
        self.url = spec.url
        self.metrics = metrics
        self.options = options
        #: The engine's name: the override, else what detection found, else "unknown".
        self.engine = spec.engine or UNKNOWN
        #: Until detected, requests are read as a generic OpenAI-compatible server's.
        self.dialect: Dialect = get_dialect(spec.engine or GENERIC)
        # a precision table per upstream: one model name can be served at different
        # precisions by different engines (the side-by-side comparison the tool is for)
        self.precision = PrecisionTable(dict(options.precision), model_dir=options.model_dir)
        self.precision_read: set[str] = set()  # models whose precision the engine was asked
        self.configured_models = set(options.models)
        #: The labelled models (at most --max-models of the list, kept while listed).
        self.models: set[str] = set()
        #: Every name the engine lists (bounded by the model-list read), for routing.
        self.routable: set[str] = set()
        #: None until the first probe answered or failed.
        self.up: bool | None = None
        #: Why it is down (shown on the status page), None while up.
        self.reason: str | None = None
        self.weight = spec.weight
        #: monotonic time a relayed request last got an answer under 500 (probes skip).
        self.last_ok = 0.0
        #: Not probed back before this monotonic time (ejected: backoff).
        self.retry_at = 0.0
        self._down_backoff = BACKOFF_START
        self._fails_5xx = 0  # real requests failed in a row (5xx, timeouts, cut answers)
        self._ejections = 0  # ejections since a request last succeeded: the backoff grows
        #: Held back from its pool until this monotonic time (a 429's Retry-After).
        self.hold_until = 0.0
        #: Back after an ejection, no real request succeeded yet: one at a time (half-open).
        self.trial = False
        self._trial_sent = -math.inf  # when the trial's request was let through
        #: Measured seconds per request (an average that forgets), for least-loaded.
        self.service_s: float | None = None
        #: The engine's own running / waiting requests and KV use (engine_state sets them).
        self.engine_load: tuple[float | None, float | None, float | None] = (None, None, None)
        #: Set when the upstream was ejected: its health loop probes it back now.
        self.wake = asyncio.Event()
        self._refresh_lock = asyncio.Lock()
        #: Called when up/down changes (the pools' gauges).
        self.on_change: list[Any] = []
        #: Set once the first probe answered or failed (requests that come before it wait
        #: for it, briefly: they are then read in the right engine's dialect).
        self.probed = asyncio.Event()
        self._backoff = 0.5
        self.gate = AdmissionGate(options.max_concurrency, options.max_queue, options.queue_timeout)
        client = options.client if spec.tls is None else replace(options.client, tls=spec.tls)
        #: What the relay sends through (its own pool), and the timeouts each request takes.
        self.transport: LeanTransport = make_transport(client, spec.name)
        self.timeouts = client.timeouts()
        #: The proxy's own calls (probes, model lists, gauges), over the same transport.
        self.client = make_client(spec.url, client, spec.api_key, self.transport)
        self._label_cache: dict[str, str] = {}
        #: KV-cache shapes read from the engine (None: it does not say), the element type
        #: the engine reports per model, and the series published from them.
        self.kv_shapes: dict[str, KVShape | None] = {}
        self.kv_engine_dtype: dict[str, str] = {}
        self._kv_overrides = dict(options.kv_cache_dtype)
        self._kv_models: dict[str, KVModel] = {}
        self._kv_published: dict[str, tuple[str, str, str, str]] = {}
        #: The request path's exchanges (proxy.core.exchange) admitted and not finished:
        #: the fleet only counts them (it sits below the request path, so it does not name
        #: their type). Side services read them to classify the GPU's state and to see
        #: stalls: a request with no first token yet is in prefill, one with it decodes.
        self.active: set[Any] = set()
        #: Streams in flight whose output stopped (proxy.services.stall sets them): a pool
        #: sends new requests elsewhere, readiness reports the reason.
        self.stalled = 0
        self.stall_reason: str | None = None
        #: Streams held back by their own clients (never stalls), from the same scan.
        self.client_held = 0
        #: How many of them per model label (the decode batch a request joins).
        self.active_by_model: dict[str, int] = {}

    # --- labels ---------------------------------------------------------------------

    def model_label(self, model: str | None) -> str:
        """The bounded `model` label for a client-supplied model name."""
        if model is None:
            return next(iter(self.models)) if len(self.models) == 1 else OTHER
        label = self._label_cache.get(model)
        if label is None:
            label = self.canonical(model)
            if label is None and self.dialect.answers_any_model and len(self.models) == 1:
                label = next(iter(self.models))  # the engine answers any name with its model
            label = label or OTHER
            if len(self._label_cache) < 4096 and len(model) <= 256:  # a client's text
                self._label_cache[model] = label
        return label

    def precision_of(self, model_label: str) -> Precision:
        if model_label == OTHER:
            return Precision.unknown()
        return self.precision.get(model_label)

    def kv_of(self, model_label: str) -> KVModel | None:
        """The model's KV cache as far as it is known; None for ``other``."""
        if model_label == OTHER:
            return None
        kv = self._kv_models.get(model_label)
        if kv is None:
            shape = self.kv_shapes.get(model_label)
            reported = self.kv_engine_dtype.get(model_label)
            if reported == "auto":  # the engine keeps it in the model's dtype: the config's
                reported = shape.dtype if shape is not None else None
            dtype = (
                self._kv_overrides.get(model_label)
                or self._kv_overrides.get(self.name)
                or reported
                or self.dialect.kv_default_dtype
            )
            kv = self._kv_models[model_label] = KVModel(shape, dtype)
        return kv

    def set_kv_dtype(self, model: str, dtype: str) -> None:
        """The element type the engine says it keeps a model's KV cache in."""
        if self.kv_engine_dtype.get(model) != dtype:
            self.kv_engine_dtype[model] = dtype
            self._kv_models.pop(model, None)
            self.publish_kv()

    def publish_kv(self) -> None:
        """phasewatch_model_kv_bytes_per_token for every model (NaN where unknown)."""
        gauge = self.metrics.model_kv_bytes_per_token
        for model in sorted(self.models | self.configured_models):
            kv = self.kv_of(model)
            per_token = kv.bytes_per_token if kv is not None else None
            dtype = kv.dtype if kv is not None and per_token is not None else "unknown"
            labels = (self.name, model, self.precision.get(model).precision, dtype or "unknown")
            old = self._kv_published.get(model)
            if old is not None and old != labels:
                try:
                    gauge.remove(*old)
                except KeyError:
                    pass
            gauge.labels(*labels).set(per_token if per_token is not None else math.nan)
            self._kv_published[model] = labels
        for model in set(self._kv_published) - (self.models | self.configured_models):
            try:
                gauge.remove(*self._kv_published.pop(model))
            except KeyError:
                pass

    def canonical(self, model: str) -> str | None:
        """The listed name a request's model means (Ollama: ``llama3.2`` is
        ``llama3.2:latest``), or None when the upstream does not list it."""
        if model in self.configured_models:
            return model
        return self.dialect.canonical(model, self.models)

    def serves(self, model: str | None) -> bool:
        """Whether the upstream lists `model` (its whole list, not only the labelled)."""
        if model is None:
            return False
        if model in self.configured_models:
            return True
        dialect = self.dialect
        return (
            dialect.canonical(model, self.routable) is not None
            or dialect.canonical(model, self.models) is not None
        )

    def set_engine(self, engine: str) -> None:
        if engine != self.engine:
            try:
                self.metrics.upstream_up.remove(self.name, self.engine)
            except KeyError:
                pass
            self.engine = engine
            self.dialect = get_dialect(engine)
            self._label_cache.clear()
            self._kv_models.clear()

    # --- engine and model list (off the request path) -----------------------------------

    async def refresh(self) -> None:
        """Read the engine's model list; keeps the old list when the engine is down. The
        engine is (re)detected when the upstream was down (or at start)."""
        try:
            async with self._refresh_lock:  # the refresh and the health loop both call it
                await self._refresh()
        except Exception:
            self._set_up(False)  # an answer that broke a probe: down until one works
            raise
        finally:
            self.probed.set()

    async def _refresh(self) -> None:
        if self.spec.engine is None and not self.up:
            engine = await detect_engine(self.client)
            if engine is not None:
                self.set_engine(engine)
        query = ModelQuery(
            self.client, self.options.max_models, self.precision_read, self.options.model_dir
        )
        query.fits = functools.partial(self.metrics.labels.fits, self.name, "model")
        listed = await self.dialect.list_models(query)
        if listed is None:  # say why: the health probe names a refused or silent engine
            reason = await self.check()
            self._set_up(False, reason or "it answers, but not with a model list")
            return
        for model, p in listed.precision.items():
            self.precision_read.add(model)
            self.precision.set_engine(model, p)  # its source says whether the engine or a name told
        for model, shape in listed.kv.items():
            self.kv_shapes[model] = shape
            self._kv_models.pop(model, None)
        self.precision_read &= set(listed.names)  # a model that comes back is read again
        self.routable = set(listed.names)
        new = self._labelled(listed.names)
        came_up = not self.up
        if new != self.models:
            self.models = new
            self._label_cache.clear()
            self.publish_models()
        self._set_up(True)
        if came_up:
            log.info(
                "upstream %s (%s) is up: engine %s, models %s",
                self.name,
                self.url,
                self.engine,
                ",".join(sorted(new)) or "-",
            )

    def _labelled(self, names: list[str]) -> set[str]:
        """The names that get their own label: those labelled before and still listed,
        then new ones in the engine's order, up to --max-models."""
        listed = set(names)
        keep = {m for m in self.models if m in listed}
        for name in names:
            if len(keep) >= self.options.max_models:
                break
            keep.add(name)
        return keep

    def _set_up(self, up: bool, reason: str | None = None) -> None:
        if not up and self.up is not False:
            log.warning(
                "upstream %s (%s) is not answering its model list; requests to it "
                "get 502 until it does (engine %s; %s)",
                self.name,
                self.url,
                self.engine,
                reason or self.reason or "model list not read",
            )
        changed = up != self.up
        self.up = up
        if up:
            self.reason = None
            self._down_backoff = BACKOFF_START
            self._fails_5xx = 0
            if changed and self._ejections:  # back after an ejection: real traffic decides
                self.trial = True
                self._trial_sent = -math.inf
        elif reason is not None or self.reason is None:
            self.reason = reason or "model list not read"
        self.metrics.upstream_up.labels(self.name, self.engine).set(1 if up else 0)
        if changed:
            for hook in self.on_change:
                hook(self)

    # --- health on the request path, and the idle probe ------------------------------

    def eject(self, kind: str, reason: str) -> None:
        """Mark the upstream down at once (a refused connection, a failed request); it is
        probed back after a backoff. `kind` is the bounded label of the counter."""
        was, on_trial = self.up, self.trial
        self._set_up(False, reason)
        self.trial = False
        if was is not False:
            self.metrics.upstream_ejections_total.labels(self.name, kind).inc()
            self._ejections += 1
            # failed again on trial, its probe passing: real traffic is what fails, and
            # a 5xx cannot be retried elsewhere, so it is tried less and less often
            longest = max(
                self.options.health_backoff_max,
                self.options.eject_backoff_max if on_trial else 0.0,
            )
            hold = min(BACKOFF_START * 2 ** min(self._ejections - 1, 16), longest)
            self._down_backoff = max(self._down_backoff, hold)
        # jittered, so members ejected together do not all come back at one moment
        self.retry_at = time.monotonic() + self._down_backoff * random.uniform(0.75, 1.25)
        self.wake.set()

    def answered(self, status: int, retry_after: str | None = None) -> None:
        """A relayed request got its response head: a 5xx is a failure (see
        :meth:`failed`), a 429 holds the upstream back for its `retry_after`. Neither a
        head nor a 4xx is a success: :meth:`succeeded` is, once the answer is whole."""
        if status >= 500:
            self.failed("http_5xx", f"HTTP {status}")
        elif status == 429:
            self.hold(retry_after)

    def failed(self, kind: str, what: str) -> None:
        """A real request failed (a 5xx, no answer in time, an answer cut short): one
        more in a row; --eject-after-5xx in a row eject the upstream, and so does any
        failure while it is on trial."""
        if not self.options.eject_after_5xx:
            return
        self._fails_5xx += 1
        if self.up and (self.trial or self._fails_5xx >= self.options.eject_after_5xx):
            how = "on trial after an ejection" if self.trial else "in a row"
            self.eject(kind, f"{what} on {self._fails_5xx} requests {how}")

    def succeeded(self) -> None:
        """A real request's whole answer arrived under 400: the failure streak, the
        ejections' backoff and any trial end, and the idle probe is skipped."""
        self._fails_5xx = 0
        self._ejections = 0
        self.trial = False
        self.last_ok = time.monotonic()

    def hold(self, retry_after: str | None) -> None:
        """A 429: no new requests from its pool for `retry_after` seconds (a number, or
        an HTTP date; at most MAX_HOLD, DEFAULT_HOLD without one), a tenth jittered."""
        seconds = retry_seconds(retry_after)
        until = time.monotonic() + seconds * random.uniform(1.0, 1.1)
        if until > self.hold_until:
            if self.hold_until < time.monotonic():  # a new hold, not one extended
                self.metrics.upstream_ejections_total.labels(self.name, "retry_after").inc()
            self.hold_until = until

    def available(self, now: float) -> bool:
        """Whether its pool may send it a new request now: not held back by a 429, and
        on trial only while no trial request is out. Picking it first for a request
        (:meth:`picked`) takes the trial's one place."""
        if now < self.hold_until:
            return False
        return not self.trial or now - self._trial_sent >= TRIAL_WAIT

    def picked(self, now: float) -> None:
        """Its pool gave it a request: on trial, the one request let through."""
        if self.trial:
            self._trial_sent = now

    def observe(self, seconds: float) -> None:
        """A finished request's seconds from admission to end (least-loaded's rate)."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        old = self.service_s
        self.service_s = seconds if old is None else old + SERVICE_ALPHA * (seconds - old)

    async def check(self) -> str | None:
        """One cheap health probe: None when the engine answers under 500, else why."""
        path = self.dialect.health_path
        timeout = self.options.health_timeout
        try:
            async with self.client.stream("GET", path, timeout=timeout) as resp:
                status = resp.status_code
        except httpx.HTTPError as exc:
            return failure_reason(exc, path)
        return f"HTTP {status} on {path}" if status >= 500 else None

    async def health_step(self) -> float:
        """One turn of the health loop; returns the seconds until the next."""
        interval = self.options.health_interval
        now = time.monotonic()
        if self.up is None:
            return BACKOFF_START  # the first probe is the model-list refresh's
        if self.up:
            idle = now - self.last_ok
            if idle < interval:  # real traffic answered just now: no probe needed
                return interval - idle
            reason = await self.check()
            if reason is not None:
                self.eject("probe", reason)
                return max(self.retry_at - time.monotonic(), 0.0)
            return interval
        if now < self.retry_at:
            return self.retry_at - now
        reason = await self.check()
        if reason is None:
            try:
                await self.refresh()  # back: detect the engine again, read its models
            except Exception:  # noqa: BLE001 - the refresh loop logs its own failures
                reason = self.reason or "model list not read"
            else:
                reason = None if self.up else (self.reason or "model list not read")
        if reason is not None:
            if self.up:  # back meanwhile (the model-list refresh saw it): no stale reason
                return interval
            if self.reason != reason:
                self.reason = reason
            self._down_backoff = min(self._down_backoff * 2, self.options.health_backoff_max)
            self.retry_at = time.monotonic() + self._down_backoff
            return self._down_backoff
        return interval

    def next_probe_delay(self, interval: float) -> float:
        """Seconds until the next probe: `interval` while the upstream answers; while it
        does not (an engine still loading, restarting), 0.5 s doubling up to `interval`,
        so it is detected and measured soon after it comes up."""
        if self.up:
            self._backoff = 0.5
            return interval
        delay = min(self._backoff, interval)
        self._backoff = min(self._backoff * 2, interval)
        return delay

    def state(self) -> dict[str, Any]:
        """What the other workers of the host need to know of this upstream."""
        return {
            "engine": self.engine,
            "up": self.up,
            "reason": None if self.up else self.reason,
            "routable": sorted(self.routable),
            "models": sorted(self.models),
            "precision": {m: list(astuple(self.precision.get(m))) for m in sorted(self.models)},
            "kv": {
                m: (list(astuple(s)) if s is not None else None) for m, s in self.kv_shapes.items()
            },
            "kv_dtype": dict(self.kv_engine_dtype),
        }

    def apply(self, state: dict[str, Any]) -> None:
        """Take the primary worker's view of this upstream (see :meth:`state`)."""
        engine = state.get("engine")
        if isinstance(engine, str) and engine != UNKNOWN and self.spec.engine is None:
            self.set_engine(engine)
        for model, p in (state.get("precision") or {}).items():
            self.precision.set_engine(model, Precision(*p))
        for model, shape in (state.get("kv") or {}).items():
            self.kv_shapes[model] = KVShape(*shape) if shape else None
        self.kv_engine_dtype.update(state.get("kv_dtype") or {})
        self._kv_models.clear()
        models = set(state.get("models") or ())
        if models != self.models:
            self.models = models
            self._label_cache.clear()
            self.publish_models()
        self.routable = set(state.get("routable") or models)
        self.publish_kv()
        up = state.get("up")
        if up is not None:
            reason = state.get("reason")
            changed = bool(up) != self.up
            self.up = bool(up)
            self.reason = reason if isinstance(reason, str) and not up else None
            self.metrics.upstream_up.labels(self.name, self.engine).set(1 if up else 0)
            if changed:
                for hook in self.on_change:
                    hook(self)
        self.probed.set()

    def publish_models(self) -> None:
        for model in sorted(self.models | self.configured_models):
            p = self.precision.get(model)
            self.metrics.model_info.labels(
                self.name, model, p.precision, p.quant, p.source, model_family(model)
            ).set(1)
        self.publish_kv()

    async def aclose(self) -> None:
        await self.client.aclose()
