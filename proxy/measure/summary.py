"""The benchmark table computed from phasewatch's own samples: per upstream x model x
precision, decode tok/s, prefill ms/token and TTFT by prompt band, power, energy per
token (at decode load, all-in and attributed), phase shares and speed-ups against the
unquantised row of the same model family.

Pure: samples in (a ``/metrics`` page, a Prometheus server's answers, or the proxy's own
registry), a :class:`Report` out. ``phasewatch report`` renders it; the status page
serves it as JSON.

Medians come from histogram buckets, interpolated linearly inside the bucket as
Prometheus' ``histogram_quantile`` does, except that when the mean (``_sum / _count``)
falls inside the bucket holding the median, the mean is used: for the tight clusters that
serving figures form (one model, one precision, one band) it is far closer than a straight
line across a bucket 26 % wide, and it never leaves the bucket the histogram allows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .metrics import PREFIX, PROMPT_BANDS
from .precision import GGUF_TYPE_RE

#: The bands the benchmark table reports: ~4K and ~16K for prefill, ~8K for TTFT.
BAND_4K, BAND_8K, BAND_16K = "2k-6k", "6k-12k", "12k-24k"
#: Display names of the bands.
BAND_TITLES = {
    "0-2k": "<2K",
    "2k-6k": "~4K",
    "6k-12k": "~8K",
    "12k-24k": "~16K",
    "24k-64k": "24-64K",
    "64k+": "64K+",
    "unknown": "?",
}
#: Which precisions count as the unquantised baseline, best first.
BASELINES = ("bf16", "fp16", "fp32")
#: Row order within a model family: the baseline first, then by falling bit width.
PRECISION_ORDER = (
    "bf16",
    "fp16",
    "fp32",
    "fp8",
    "int8",
    "fp6",
    "int6",
    "int5",
    "fp4",
    "int4",
    "int3",
    "int2",
    "int1",
    "unknown",
)
#: Requests (each side) a derived figure needs before it is shown: a speed-up, a power
#: saving, J/token. Below it the figure is None and ``Row.unresolved`` says why; where it
#: is shown, its count (``Row.counts``) and band are shown beside it. One constant for
#: every surface (page, ``report``, ``advise``, ``bench``'s reading of the proxy).
MIN_FIGURE_REQUESTS = 10
#: Band preference when comparing prefill between two rows.
PREFILL_COMPARE = ("2k-6k", "6k-12k", "12k-24k", "24k-64k", "64k+", "0-2k", "unknown")

# --- samples ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


class Samples:
    """A flat list of samples (name, labels, value) with simple label matching."""

    def __init__(self, items: Iterable[Sample]) -> None:
        self.by_name: dict[str, list[Sample]] = {}
        for s in items:
            self.by_name.setdefault(s.name, []).append(s)

    @classmethod
    def from_text(cls, text: str) -> Samples:
        return cls(
            Sample(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        )

    @classmethod
    def from_registry(cls, registry: Collector) -> Samples:
        return cls(
            Sample(s.name, dict(s.labels), float(s.value))
            for fam in registry.collect()
            for s in fam.samples
        )

    def get(self, name: str, **match) -> list[Sample]:
        return [
            s
            for s in self.by_name.get(name, ())
            if all(s.labels.get(k) == v for k, v in match.items())
        ]

    def total(self, name: str, **match) -> float:
        return sum(s.value for s in self.get(name, **match))

    def has(self, name: str) -> bool:
        return bool(self.by_name.get(name))


@dataclass
class Hist:
    """A histogram merged over the label values it was not asked about."""

    buckets: list[tuple[float, float]]  # (le, cumulative count), +Inf last
    sum: float
    count: float

    def quantile(self, q: float) -> float | None:
        return quantile(q, self.buckets, self.sum, self.count)

    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None


def hist(samples: Samples, name: str, **match) -> Hist:
    buckets: dict[float, float] = {}
    for s in samples.get(name + "_bucket", **match):
        le = float(s.labels.get("le", "inf"))
        buckets[le] = buckets.get(le, 0.0) + s.value
    return Hist(
        sorted(buckets.items()),
        samples.total(name + "_sum", **match),
        samples.total(name + "_count", **match),
    )


def quantile(
    q: float,
    buckets: list[tuple[float, float]],
    total: float | None = None,
    count: float | None = None,
) -> float | None:
    """Prometheus-style histogram_quantile over cumulative (le, count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    n = buckets[-1][1]
    rank = q * n
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank and c > prev_c:
            if math.isinf(le):
                return prev_le  # the largest finite bound, as Prometheus does
            if total is not None and count:
                mean = total / count
                if prev_le <= mean <= le:  # a tight cluster: the mean is the better median
                    return mean
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return None


# --- model families ----------------------------------------------------------------------

_QUANT_WORD = re.compile(
    r"(bf16|fp16|f16|fp32|f32|fp8|fp6|fp4|nvfp4|mxfp4|int8|int4|int3|int2|w\d+a\d+|awq|gptq|"
    r"gguf|ggml|exl2|hqq|bnb|mlx|marlin|quantized|quant|dynamic|\d+bit|q\d+|iq\d+)",
    re.IGNORECASE,
)


def model_family(model: str) -> str:
    """The model without its publisher and quantisation markers, so that
    ``meta-llama/Llama-3.1-8B-Instruct``, ``RedHatAI/Llama-3.1-8B-Instruct-FP8`` and
    ``llama3.1:8b-instruct-q4_K_M`` vs ``llama3.1:8b-instruct-fp16`` pair up."""
    base = re.sub(r"\.(gguf|bin|safetensors)$", "", model.rsplit("/", 1)[-1], flags=re.IGNORECASE)
    base = GGUF_TYPE_RE.sub(" ", base)
    parts = [p for p in re.split(r"[-_:\s]+", base) if p and not _QUANT_WORD.fullmatch(p)]
    return "-".join(parts).lower()


# --- the table -----------------------------------------------------------------------------


@dataclass
class Row:
    upstream: str
    model: str
    precision: str
    quant: str = ""
    family: str = ""
    engine: str = ""  # the engine behind the upstream, as the proxy recognised it
    requests: float = 0  # every outcome
    errors: float = 0  # failed or refused (outcome error or rejected)
    aborted: float = 0  # the client hung up
    in_flight: float = 0
    queued: float = 0
    prompt_tokens: float = 0
    decode_tokens: float = 0
    decode_tok_s: float | None = None
    decode_source: str | None = None
    decode_samples: float = 0
    decode_tok_s_by_band: dict = field(default_factory=dict)
    prefill_source: str | None = None
    prefill_ms_per_token: dict = field(default_factory=dict)  # band -> ms/token
    prefill_tok_s: dict = field(default_factory=dict)  # band -> tok/s
    ttft_s: dict = field(default_factory=dict)  # band -> median seconds
    ttft_all_s: float | None = None
    share_prefill: float | None = None
    share_decode: float | None = None
    decode_watts: float | None = None
    prefill_watts: float | None = None
    idle_watts: float | None = None
    # Three energy-per-token figures (docs/metrics.md defines each once):
    joules_per_token_at_decode: float | None = None  # decode W / decode tok/s
    joules_per_token_all_in: float | None = None  # whole GPU energy / generated tokens
    joules_per_token_attributed: float | None = None  # requests' energy / generated tokens
    baseline: str | None = None  # "model (precision)" of the row compared against
    decode_speedup: float | None = None
    prefill_speedup: float | None = None
    prefill_speedup_band: str | None = None
    power_saving: float | None = None  # 1 - decode W / baseline decode W
    energy_saving: float | None = None  # 1 - J/token at decode / the baseline's
    prefill_samples: dict = field(default_factory=dict)  # band -> requests behind its rate
    decode_watts_samples: float = 0  # requests whose decode window the sensor resolved
    decode_batch: str | None = None  # the batch band most decode time was spent at
    # derived figure -> the requests it rests on (the fewer of the two rows compared),
    # also where too few to show it
    counts: dict = field(default_factory=dict)
    # derived figure -> why it is not shown (too few requests, the sensor, no baseline)
    unresolved: dict = field(default_factory=dict)
    tpot_ms: float | None = None  # median time per output token
    kv_bytes_per_token: float | None = None  # None: the model's KV shape is unknown
    kv_dtype: str = "unknown"  # the element type the engine keeps the cache in
    kv_request_bytes: float | None = None  # median KV-cache bytes a request held
    kv_capacity_tokens: float | None = None  # the engine's KV-cache size, where it says
    kv_fit_requests: float | None = None  # requests of median size the cache holds at once
    engine_slots: float | None = None  # requests the engine runs at once at most (llama-server -np)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.upstream, self.model, self.precision)

    @property
    def measured(self) -> bool:
        """Whether any figure of the table was measured for this row (a model that only
        had errors, or was never asked for, has none)."""
        return bool(
            self.decode_tok_s is not None
            or self.prefill_ms_per_token
            or self.ttft_s
            or self.share_prefill is not None
            or self.decode_watts is not None
            or self.tpot_ms is not None
            or self.kv_request_bytes is not None
        )


@dataclass
class Report:
    rows: list[Row]
    power: bool  # whether any power series exist
    source: str
    gpus: list = field(default_factory=list)  # latest sample per GPU, with its labels

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "power_sampled": self.power,
            "bands": {b: BAND_TITLES[b] for b in PROMPT_BANDS},
            "gpus": self.gpus,
            "rows": [asdict(r) for r in self.rows],
        }


def _n(name: str) -> str:
    return PREFIX + name


def build(samples: Samples, source: str = "", include_idle_models: bool = False) -> Report:
    """Compute the table from a set of phasewatch samples."""
    keys: set[tuple[str, str, str]] = set()
    for name in ("requests_total", "ttft_seconds_count", "decode_tokens_per_second_count"):
        for s in samples.get(_n(name)):
            if s.value > 0:
                keys.add(
                    (
                        s.labels.get("upstream", ""),
                        s.labels.get("model", ""),
                        s.labels.get("precision", "unknown"),
                    )
                )
    quants = {}
    for s in samples.get(_n("model_info")):
        k = (
            s.labels.get("upstream", ""),
            s.labels.get("model", ""),
            s.labels.get("precision", "unknown"),
        )
        quants[k] = s.labels.get("quant", "")
        if include_idle_models and s.value > 0:
            keys.add(k)

    power = any(
        samples.has(_n(n))
        for n in (
            "gpu_power_sample_watts_count",
            "gpu_energy_joules_total",
            "gpu_power_watts_count",
            "gpu_power_current_watts",
        )
    )
    engines = {
        s.labels.get("upstream", ""): s.labels.get("engine", "")
        for s in samples.get(_n("upstream_up"))
    }
    rows_per_upstream: dict[str, int] = {}
    for up, _, _ in keys:
        rows_per_upstream[up] = rows_per_upstream.get(up, 0) + 1

    rows = []
    for up, model, prec in sorted(keys, key=_row_order):
        lab = {"upstream": up, "model": model, "precision": prec}
        r = Row(
            up,
            model,
            prec,
            quant=quants.get((up, model, prec), ""),
            family=model_family(model),
            engine=engines.get(up, ""),
        )
        r.requests = samples.total(_n("requests_total"), **lab)
        r.errors = sum(
            samples.total(_n("requests_total"), **lab, outcome=o) for o in ("error", "rejected")
        )
        r.aborted = samples.total(_n("requests_total"), **lab, outcome="aborted")
        r.in_flight = samples.total(_n("in_flight_requests"), **lab)
        r.queued = samples.total(_n("queued_requests"), **lab)
        r.prompt_tokens = samples.total(_n("tokens_total"), **lab, phase="prefill") + samples.total(
            _n("tokens_total"), **lab, phase="cached"
        )
        r.decode_tokens = samples.total(_n("tokens_total"), **lab, phase="decode")

        # decode: the proxy's own measurement of streams first, the engine's otherwise
        for src in ("proxy", "engine"):
            h = hist(samples, _n("decode_tokens_per_second"), **lab, source=src)
            if h.count:
                r.decode_tok_s, r.decode_source, r.decode_samples = h.quantile(0.5), src, h.count
                for band in PROMPT_BANDS:
                    hb = hist(
                        samples, _n("decode_tokens_per_second"), **lab, source=src, prompt_band=band
                    )
                    if hb.count:
                        r.decode_tok_s_by_band[band] = hb.quantile(0.5)
                break
        # prefill: the engine's own figure first (it excludes engine queueing)
        for src in ("engine", "proxy"):
            if hist(samples, _n("prefill_tokens_per_second"), **lab, source=src).count:
                r.prefill_source = src
                for band in PROMPT_BANDS:
                    hb = hist(
                        samples,
                        _n("prefill_tokens_per_second"),
                        **lab,
                        source=src,
                        prompt_band=band,
                    )
                    rate = hb.quantile(0.5) if hb.count else None
                    if rate:
                        r.prefill_tok_s[band] = rate
                        r.prefill_ms_per_token[band] = 1000.0 / rate
                        r.prefill_samples[band] = hb.count
                break
        for band in PROMPT_BANDS:
            hb = hist(samples, _n("ttft_seconds"), **lab, prompt_band=band)
            if hb.count:
                r.ttft_s[band] = hb.quantile(0.5)
        r.ttft_all_s = hist(samples, _n("ttft_seconds"), **lab).quantile(0.5)

        pre = samples.total(_n("prefill_seconds_sum"), **lab, source="proxy")
        dec = samples.total(_n("decode_seconds_sum"), **lab, source="proxy")
        if pre + dec > 0:
            r.share_prefill, r.share_decode = pre / (pre + dec), dec / (pre + dec)

        # power
        decode_w = hist(samples, _n("gpu_power_watts"), **lab, phase="decode")
        r.decode_watts, r.decode_watts_samples = decode_w.mean(), decode_w.count
        prefill_w = hist(samples, _n("gpu_power_watts"), **lab, phase="prefill")
        r.prefill_watts = prefill_w.mean()
        if r.prefill_watts is not None:
            r.counts["prefill_watts"] = prefill_w.count
        gpus, own = _gpus_of(samples, up, model)
        attributable = own or rows_per_upstream.get(up) == 1
        if attributable:
            if r.decode_watts is None:
                # the sampled power in the decode state: counted in samples, not requests
                r.decode_watts = _state_watts(samples, gpus, "decode")
                r.decode_watts_samples = sum(
                    samples.total(_n("gpu_power_sample_watts_count"), **g, state="decode")
                    for g in gpus
                )
            if r.prefill_watts is None:
                r.prefill_watts = _state_watts(samples, gpus, "prefill")
            energy = sum(samples.total(_n("gpu_energy_joules_total"), **g) for g in gpus)
            if energy and r.decode_tokens:
                r.joules_per_token_all_in = energy / r.decode_tokens
        attributed = samples.total(_n("request_energy_joules_total"), **lab)
        if attributed and r.decode_tokens:
            r.joules_per_token_attributed = attributed / r.decode_tokens
        r.idle_watts = _state_watts(samples, gpus, "idle")
        r.decode_batch = decode_batch(samples, lab)
        jtok_n = min(r.decode_watts_samples, r.decode_samples)
        if r.decode_watts is not None and r.decode_tok_s:
            if jtok_n >= MIN_FIGURE_REQUESTS:
                r.joules_per_token_at_decode = r.decode_watts / r.decode_tok_s
                r.counts["joules_per_token_at_decode"] = jtok_n
            else:
                r.unresolved["joules_per_token_at_decode"] = _too_few(jtok_n, "decode power")
            r.counts["joules_per_token_at_decode"] = jtok_n
        kv_memory(samples, lab, r)
        rows.append(r)

    compare(rows)
    gpus_now = [
        {
            **{k: s.labels.get(k, "") for k in ("upstream", "model", "precision", "gpu")},
            "watts": s.value,
        }
        for s in samples.get(_n("gpu_power_current_watts"))
    ]
    return Report(rows, power, source, gpus_now)


def _too_few(n: float, what: str) -> str:
    return f"{what} measured on {n:.0f} requests; {MIN_FIGURE_REQUESTS} needed"


def decode_batch(samples: Samples, lab: dict) -> str | None:
    """The batch band (requests in flight when a request was admitted) most of this
    row's decode time was spent at, from ``decode_batch_seconds_total``."""
    seconds: dict[str, float] = {}
    for s in samples.get(_n("decode_batch_seconds_total"), **lab):
        b = s.labels.get("batch", "")
        seconds[b] = seconds.get(b, 0.0) + s.value
    seconds = {b: v for b, v in seconds.items() if v > 0}
    return max(seconds, key=seconds.__getitem__) if seconds else None


def kv_memory(samples: Samples, lab: dict, r: Row) -> None:
    """Time per output token and the KV-cache figures of one row: bytes per token (the
    gauge; NaN or absent where unknown), the median bytes a request held, the engine's
    capacity, and how many requests of that median size it holds at once (never more
    than the engine's slots, where it has a fixed number)."""
    for src in ("proxy", "engine"):
        h = hist(samples, _n("time_per_output_token_seconds"), **lab, source=src)
        if h.count:
            median = h.quantile(0.5)
            r.tpot_ms = median * 1000.0 if median is not None else None
            break
    for s in samples.get(_n("model_kv_bytes_per_token"), **lab):
        if not math.isnan(s.value):
            r.kv_bytes_per_token = s.value
            r.kv_dtype = s.labels.get("kv_dtype", "unknown")
    h = hist(samples, _n("kv_cache_bytes"), **lab)
    r.kv_request_bytes = h.quantile(0.5) if h.count else None
    capacity = [s.value for s in samples.get(_n("engine_kv_cache_capacity_tokens"), **lab)]
    r.kv_capacity_tokens = max(capacity) if capacity else None
    slots = [s.value for s in samples.get(_n("engine_slots"), **lab)]
    r.engine_slots = max(slots) if slots else None
    if r.kv_capacity_tokens and r.kv_bytes_per_token and r.kv_request_bytes:
        r.kv_fit_requests = r.kv_capacity_tokens * r.kv_bytes_per_token / r.kv_request_bytes
        if r.engine_slots:  # llama-server: one request per slot, whatever the cache holds
            r.kv_fit_requests = min(r.kv_fit_requests, r.engine_slots)


def _gpus_of(samples: Samples, upstream: str, model: str) -> tuple[list[dict], bool]:
    """The GPUs serving a row, as label sets of their GPU-keyed series, and whether they
    are the model's own (``--power-gpu GPU=MODEL``) rather than shared by the upstream."""
    own, shared = {}, {}
    for s in samples.get(_n("gpu_power_sample_watts_count")) + samples.get(
        _n("gpu_energy_joules_total")
    ):
        labels = {k: v for k, v in s.labels.items() if k not in ("state", "le")}
        if upstream not in labels.get("upstream", "").split("+"):
            continue
        key = tuple(sorted(labels.items()))
        if labels.get("model") == model:
            own[key] = labels
        elif labels.get("model") in (None, "all"):
            shared[key] = labels
    return (list(own.values()), True) if own else (list(shared.values()), False)


def _state_watts(samples: Samples, gpus: list[dict], state: str) -> float | None:
    """Mean sampled power in a state, summed over the GPUs. One GPU may have several label
    sets (its precision label changes once the engine has said what it serves): their
    samples are that one GPU's, averaged together, not added up."""
    per_gpu: dict[str, list[float]] = {}
    for g in gpus:
        c = samples.total(_n("gpu_power_sample_watts_count"), **g, state=state)
        if c:
            acc = per_gpu.setdefault(g.get("gpu", ""), [0.0, 0.0])
            acc[0] += samples.total(_n("gpu_power_sample_watts_sum"), **g, state=state)
            acc[1] += c
    return sum(total / count for total, count in per_gpu.values()) if per_gpu else None


def _row_order(key: tuple[str, str, str]) -> tuple:
    up, model, prec = key
    rank = PRECISION_ORDER.index(prec) if prec in PRECISION_ORDER else len(PRECISION_ORDER)
    return (up, model_family(model), rank, model)


def compare(rows: list[Row]) -> None:
    """Speed-up and power saving of each row against its family's bf16/fp16 row."""

    def pick(cands: list[Row]) -> Row | None:
        for p in BASELINES:
            for c in cands:
                if c.precision == p:
                    return c
        return None

    for r in rows:
        base = pick([c for c in rows if c.upstream == r.upstream and c.family == r.family])
        if base is None:
            anywhere = [c for c in rows if c.family == r.family and c.precision in BASELINES]
            base = pick(anywhere) if len({c.upstream for c in anywhere}) == 1 else None
        if base is None:
            continue
        r.baseline = f"{base.model} ({base.precision})"
        _compare(r, base)


def _compare(r: Row, base: Row) -> None:
    """The derived figures of `r` against `base`, each only where both rows rest on at
    least MIN_FIGURE_REQUESTS requests (else ``r.unresolved`` says how many they had),
    with the count beside it in ``r.counts``."""
    enough = MIN_FIGURE_REQUESTS
    if r is base:  # the baseline against itself: 1x and 0 % by definition, no count
        r.decode_speedup = 1.0 if r.decode_tok_s else None
        r.prefill_speedup = 1.0 if r.prefill_ms_per_token else None
        r.power_saving = 0.0 if r.decode_watts else None
        r.energy_saving = 0.0 if r.joules_per_token_at_decode else None
        return
    if r.decode_tok_s and base.decode_tok_s:
        n = min(r.decode_samples, base.decode_samples)
        if n >= enough:
            r.decode_speedup, r.counts["decode_speedup"] = r.decode_tok_s / base.decode_tok_s, n
        else:
            r.unresolved["decode_speedup"] = _too_few(n, "decode")
            r.counts["decode_speedup"] = n
    short = None
    for band in PREFILL_COMPARE:
        mine, theirs = r.prefill_ms_per_token.get(band), base.prefill_ms_per_token.get(band)
        if mine and theirs:
            n = min(r.prefill_samples.get(band, 0), base.prefill_samples.get(band, 0))
            if n >= enough:
                r.prefill_speedup, r.prefill_speedup_band = theirs / mine, band
                r.counts["prefill_speedup"] = n
                break
            short = short or (band, n)
    if r.prefill_speedup is None and short:
        r.counts["prefill_speedup"] = short[1]
        r.unresolved["prefill_speedup"] = _too_few(
            short[1], f"prefill in one prompt band ({BAND_TITLES.get(short[0], short[0])})"
        )
    if r.decode_watts and base.decode_watts:
        n = min(r.decode_watts_samples, base.decode_watts_samples)
        if n >= enough:
            r.power_saving = 1.0 - r.decode_watts / base.decode_watts
            r.counts["power_saving"] = n
        else:
            r.unresolved["power_saving"] = _too_few(n, "decode power")
            r.counts["power_saving"] = n
    if r.joules_per_token_at_decode and base.joules_per_token_at_decode:
        r.energy_saving = 1.0 - r.joules_per_token_at_decode / base.joules_per_token_at_decode
        r.counts["energy_saving"] = min(
            r.counts["joules_per_token_at_decode"], base.counts["joules_per_token_at_decode"]
        )
