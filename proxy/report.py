"""``phasewatch report``: the seeds' "what to report" table from live traffic.

Reads phasewatch's own metrics (a ``/metrics`` page, a Prometheus server's HTTP API,
or, for the status page, the proxy's registry in-process) and computes, per upstream x
model x precision:

- decode tok/s: median of ``phasewatch_decode_tokens_per_second`` (source=proxy where
  streamed requests exist, else the engine's own figure), overall and by prompt band;
- prefill ms/token by prompt band: 1000 / median of ``phasewatch_prefill_tokens_per_second``;
- TTFT by prompt band: median of ``phasewatch_ttft_seconds``;
- power: mean decode-window and prefill-window power of requests
  (``phasewatch_gpu_power_watts``; else the GPU samples classified decode / prefill, where
  the GPUs are the model's own or its upstream serves only it), idle power of the GPUs
  serving the row (``phasewatch_gpu_power_sample_watts{state="idle"}``), and J/token:
  decode watts / decode tok/s, plus energy counter / generated tokens where attributable;
- the share of wall time spent in prefill vs decode (sums of the phase histograms);
- speed-up and power saving against the bf16/fp16 row of the same upstream and model
  family.

Medians come from histogram buckets, interpolated linearly inside the bucket as
Prometheus' ``histogram_quantile`` does, except that when the mean (``_sum / _count``)
falls inside the bucket holding the median, the mean is used: for the tight clusters that
serving figures form (one model, one precision, one band) it is far closer than a straight
line across a bucket 26 % wide, and it never leaves the bucket the histogram allows.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Iterable

from .metrics import PREFIX, PROMPT_BANDS
from .precision import _GGUF_RE  # noqa: PLC2701 - the one regex of GGUF type names

#: The bands the seeds' table names: ~4K and ~16K for prefill, ~8K for TTFT.
BAND_4K, BAND_8K, BAND_16K = "2k-6k", "6k-12k", "12k-24k"
#: Display names of the bands.
BAND_TITLES = {"0-2k": "<2K", "2k-6k": "~4K", "6k-12k": "~8K", "12k-24k": "~16K",
               "24k-64k": "24-64K", "64k+": "64K+", "unknown": "?"}
#: Which precisions count as the unquantised baseline, best first.
BASELINES = ("bf16", "fp16", "fp32")
#: Row order within a model family: the baseline first, then by falling bit width.
PRECISION_ORDER = ("bf16", "fp16", "fp32", "fp8", "int8", "fp6", "int6", "int5", "fp4", "int4",
                   "int3", "int2", "int1", "unknown")
#: Band preference when comparing prefill between two rows.
_PREFILL_COMPARE = ("2k-6k", "6k-12k", "12k-24k", "24k-64k", "64k+", "0-2k", "unknown")

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
    def from_text(cls, text: str) -> "Samples":
        from prometheus_client.parser import text_string_to_metric_families

        return cls(Sample(s.name, dict(s.labels), float(s.value))
                   for fam in text_string_to_metric_families(text) for s in fam.samples)

    @classmethod
    def from_registry(cls, registry) -> "Samples":
        return cls(Sample(s.name, dict(s.labels), float(s.value))
                   for fam in registry.collect() for s in fam.samples)

    def get(self, name: str, **match) -> list[Sample]:
        return [s for s in self.by_name.get(name, ())
                if all(s.labels.get(k) == v for k, v in match.items())]

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
    return Hist(sorted(buckets.items()), samples.total(name + "_sum", **match),
                samples.total(name + "_count", **match))


def quantile(q: float, buckets: list[tuple[float, float]], total: float | None = None,
             count: float | None = None) -> float | None:
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
    re.IGNORECASE)


def model_family(model: str) -> str:
    """The model without its publisher and quantisation markers, so that
    ``meta-llama/Llama-3.1-8B-Instruct``, ``RedHatAI/Llama-3.1-8B-Instruct-FP8`` and
    ``llama3.1:8b-instruct-q4_K_M`` vs ``llama3.1:8b-instruct-fp16`` pair up."""
    base = re.sub(r"\.(gguf|bin|safetensors)$", "", model.rsplit("/", 1)[-1], flags=re.IGNORECASE)
    base = _GGUF_RE.sub(" ", base)
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
    requests: float = 0
    errors: float = 0
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
    joules_per_token: float | None = None  # decode W / decode tok/s
    joules_per_token_energy: float | None = None  # energy counter / generated tokens
    baseline: str | None = None  # "model (precision)" of the row compared against
    decode_speedup: float | None = None
    prefill_speedup: float | None = None
    prefill_speedup_band: str | None = None
    power_saving: float | None = None  # 1 - decode W / baseline decode W
    energy_saving: float | None = None  # 1 - J/token / baseline J/token

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.upstream, self.model, self.precision)


@dataclass
class Report:
    rows: list[Row]
    power: bool  # whether any power series exist
    source: str
    gpus: list = field(default_factory=list)  # latest sample per GPU, with its labels

    def as_dict(self) -> dict:
        return {"source": self.source, "power_sampled": self.power,
                "bands": {b: BAND_TITLES[b] for b in PROMPT_BANDS},
                "gpus": self.gpus, "rows": [asdict(r) for r in self.rows]}


def _n(name: str) -> str:
    return PREFIX + name


def build(samples: Samples, source: str = "", include_idle_models: bool = False) -> Report:
    """Compute the table from a set of phasewatch samples."""
    keys: set[tuple[str, str, str]] = set()
    for name in ("requests_total", "ttft_seconds_count", "decode_tokens_per_second_count"):
        for s in samples.get(_n(name)):
            if s.value > 0:
                keys.add((s.labels.get("upstream", ""), s.labels.get("model", ""),
                          s.labels.get("precision", "unknown")))
    quants = {}
    for s in samples.get(_n("model_info")):
        k = (s.labels.get("upstream", ""), s.labels.get("model", ""), s.labels.get("precision", "unknown"))
        quants[k] = s.labels.get("quant", "")
        if include_idle_models and s.value > 0:
            keys.add(k)

    power = any(samples.has(_n(n)) for n in (
        "gpu_power_sample_watts_count", "gpu_energy_joules_total", "gpu_power_watts_count",
        "gpu_power_current_watts"))
    rows_per_upstream: dict[str, int] = {}
    for up, _, _ in keys:
        rows_per_upstream[up] = rows_per_upstream.get(up, 0) + 1

    rows = []
    for up, model, prec in sorted(keys, key=_row_order):
        lab = {"upstream": up, "model": model, "precision": prec}
        r = Row(up, model, prec, quant=quants.get((up, model, prec), ""), family=model_family(model))
        r.requests = samples.total(_n("requests_total"), **lab)
        r.errors = sum(samples.total(_n("requests_total"), **lab, outcome=o)
                       for o in ("error", "rejected"))
        r.in_flight = samples.total(_n("in_flight_requests"), **lab)
        r.queued = samples.total(_n("queued_requests"), **lab)
        r.prompt_tokens = samples.total(_n("tokens_total"), **lab, phase="prefill") + \
            samples.total(_n("tokens_total"), **lab, phase="cached")
        r.decode_tokens = samples.total(_n("tokens_total"), **lab, phase="decode")

        # decode: the proxy's own measurement of streams first, the engine's otherwise
        for src in ("proxy", "engine"):
            h = hist(samples, _n("decode_tokens_per_second"), **lab, source=src)
            if h.count:
                r.decode_tok_s, r.decode_source, r.decode_samples = h.quantile(0.5), src, h.count
                for band in PROMPT_BANDS:
                    hb = hist(samples, _n("decode_tokens_per_second"), **lab, source=src, prompt_band=band)
                    if hb.count:
                        r.decode_tok_s_by_band[band] = hb.quantile(0.5)
                break
        # prefill: the engine's own figure first (it excludes engine queueing)
        for src in ("engine", "proxy"):
            if hist(samples, _n("prefill_tokens_per_second"), **lab, source=src).count:
                r.prefill_source = src
                for band in PROMPT_BANDS:
                    hb = hist(samples, _n("prefill_tokens_per_second"), **lab, source=src, prompt_band=band)
                    rate = hb.quantile(0.5) if hb.count else None
                    if rate:
                        r.prefill_tok_s[band] = rate
                        r.prefill_ms_per_token[band] = 1000.0 / rate
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
        r.decode_watts = hist(samples, _n("gpu_power_watts"), **lab, phase="decode").mean()
        r.prefill_watts = hist(samples, _n("gpu_power_watts"), **lab, phase="prefill").mean()
        gpus, own = _gpus_of(samples, up, model)
        attributable = own or rows_per_upstream.get(up) == 1
        if attributable:
            if r.decode_watts is None:
                r.decode_watts = _state_watts(samples, gpus, "decode")
            if r.prefill_watts is None:
                r.prefill_watts = _state_watts(samples, gpus, "prefill")
            energy = sum(samples.total(_n("gpu_energy_joules_total"), **g) for g in gpus)
            if energy and r.decode_tokens:
                r.joules_per_token_energy = energy / r.decode_tokens
        r.idle_watts = _state_watts(samples, gpus, "idle")
        if r.decode_watts is not None and r.decode_tok_s:
            r.joules_per_token = r.decode_watts / r.decode_tok_s
        rows.append(r)

    compare(rows)
    gpus_now = [{**{k: s.labels.get(k, "") for k in ("upstream", "model", "precision", "gpu")},
                 "watts": s.value} for s in samples.get(_n("gpu_power_current_watts"))]
    return Report(rows, power, source, gpus_now)


def _gpus_of(samples: Samples, upstream: str, model: str) -> tuple[list[dict], bool]:
    """The GPUs serving a row, as label sets of their GPU-keyed series, and whether they
    are the model's own (``--power-gpu GPU=MODEL``) rather than shared by the upstream."""
    own, shared = {}, {}
    for s in samples.get(_n("gpu_power_sample_watts_count")) + samples.get(_n("gpu_energy_joules_total")):
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
    """Mean sampled power in a state, summed over the GPUs."""
    total, seen = 0.0, False
    for g in gpus:
        c = samples.total(_n("gpu_power_sample_watts_count"), **g, state=state)
        if c:
            total += samples.total(_n("gpu_power_sample_watts_sum"), **g, state=state) / c
            seen = True
    return total if seen else None


def _row_order(key: tuple[str, str, str]) -> tuple:
    up, model, prec = key
    rank = PRECISION_ORDER.index(prec) if prec in PRECISION_ORDER else len(PRECISION_ORDER)
    return (up, model_family(model), rank, model)


def _gpu_state_watts(samples: Samples, upstream: str, state: str) -> float | None:
    """Mean sampled power in a state, summed over the upstream's GPUs."""
    gpus = {s.labels.get("gpu") for s in samples.get(_n("gpu_power_sample_watts_count"),
                                                      upstream=upstream, state=state) if s.value}
    if not gpus:
        return None
    total = 0.0
    for gpu in gpus:
        c = samples.total(_n("gpu_power_sample_watts_count"), upstream=upstream, gpu=gpu, state=state)
        total += samples.total(_n("gpu_power_sample_watts_sum"), upstream=upstream, gpu=gpu, state=state) / c
    return total


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
        if r.decode_tok_s and base.decode_tok_s:
            r.decode_speedup = r.decode_tok_s / base.decode_tok_s
        for band in _PREFILL_COMPARE:
            mine, theirs = r.prefill_ms_per_token.get(band), base.prefill_ms_per_token.get(band)
            if mine and theirs:
                r.prefill_speedup, r.prefill_speedup_band = theirs / mine, band
                break
        if r.decode_watts and base.decode_watts:
            r.power_saving = 1.0 - r.decode_watts / base.decode_watts
        if r.joules_per_token and base.joules_per_token:
            r.energy_saving = 1.0 - r.joules_per_token / base.joules_per_token


# --- reading ---------------------------------------------------------------------------------

#: Every metric the report reads, by type (for the Prometheus API, which needs names).
_HISTOGRAMS = ("decode_tokens_per_second", "prefill_tokens_per_second", "ttft_seconds",
               "prefill_seconds", "decode_seconds", "gpu_power_watts", "gpu_power_sample_watts")
_COUNTERS = ("requests_total", "tokens_total", "gpu_energy_joules_total")
_GAUGES = ("in_flight_requests", "queued_requests", "model_info", "gpu_power_current_watts")


def load(url: str, window: str | None = None, timeout: float = 15.0) -> Samples:
    """Samples from a phasewatch /metrics URL or base URL, or a Prometheus server."""
    import httpx

    base = url.rstrip("/")
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        if not base.endswith("/metrics"):
            if _is_prometheus(client, base):
                return from_prometheus(client, base, window)
            base += "/metrics"
        if window:
            raise ValueError("--window needs a Prometheus server (a /metrics page is cumulative)")
        resp = client.get(base)
        resp.raise_for_status()
        return Samples.from_text(resp.text)


def _is_prometheus(client, base: str) -> bool:
    try:
        resp = client.get(base + "/api/v1/status/buildinfo")
        return resp.status_code == 200 and resp.json().get("status") == "success"
    except Exception:  # noqa: BLE001 - anything else is not a Prometheus server
        return False


def from_prometheus(client, base: str, window: str | None = None) -> Samples:
    """Instant queries, summed over the scrape's own labels (instance, job); with a
    window, the increase of counters and histograms over it (live rates, not totals)."""
    items = []

    def query(expr: str, name: str) -> None:
        resp = client.get(base + "/api/v1/query", params={"query": expr})
        resp.raise_for_status()
        data = resp.json()
        if data.get("status") != "success":
            raise ValueError(f"Prometheus query {expr!r} failed: {data.get('error')}")
        for r in data["data"]["result"]:
            labels = {k: v for k, v in r["metric"].items() if k != "__name__"}
            items.append(Sample(name, labels, float(r["value"][1])))

    def cumulative(name: str) -> None:
        metric = PREFIX + name
        inner = f"increase({metric}[{window}])" if window else metric
        query(f"sum without (instance, job) ({inner})", metric)

    for h in _HISTOGRAMS:
        for part in ("_bucket", "_sum", "_count"):
            cumulative(h + part)
    for c in _COUNTERS:
        cumulative(c)
    for g in _GAUGES:
        query(f"sum without (instance, job) ({PREFIX + g})", PREFIX + g)
    return Samples(items)


# --- rendering ----------------------------------------------------------------------------------


def _f(value: float | None, fmt: str = "{:.1f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.0f}%"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def markdown(rep: Report) -> str:
    na = "—" if rep.power else "n/a"
    out = []
    if not rep.rows:
        return "No measured requests yet: send some traffic through phasewatch first.\n"
    head = ("| upstream | model | precision | decode tok/s | prefill ms/tok ~4K | prefill ms/tok ~16K "
            "| TTFT ~8K | decode W | idle W | J/tok | prefill / decode time | decode speed-up "
            "| prefill speed-up | power saving |")
    out.append(head)
    out.append("|" + "---|" * head.count(" | ") + "---|")
    for r in rep.rows:
        prec = r.precision + (f" ({r.quant})" if r.quant and r.quant.lower() != r.precision else "")
        share = (f"{r.share_prefill * 100:.0f}% / {r.share_decode * 100:.0f}%"
                 if r.share_prefill is not None else "—")
        out.append(" | ".join([
            "", r.upstream, r.model, prec, _f(r.decode_tok_s),
            _f(r.prefill_ms_per_token.get(BAND_4K), "{:.3f}"),
            _f(r.prefill_ms_per_token.get(BAND_16K), "{:.3f}"),
            _f(r.ttft_s.get(BAND_8K), "{:.2f} s"),
            _f(r.decode_watts, "{:.0f}", na), _f(r.idle_watts, "{:.0f}", na),
            _f(r.joules_per_token, "{:.2f}", na), share,
            _x(r.decode_speedup), _x(r.prefill_speedup),
            _pct(r.power_saving) if rep.power else "n/a", ""]).strip())
    out.append("")
    # prompt-band detail: every band that has data
    bands = [b for b in PROMPT_BANDS if any(b in r.ttft_s or b in r.prefill_ms_per_token for r in rep.rows)]
    if bands:
        out.append("By prompt band (median TTFT s / prefill ms per token / decode tok/s):")
        out.append("")
        bh = "| upstream | model | precision | " + " | ".join(BAND_TITLES[b] for b in bands) + " |"
        out.append(bh)
        out.append("|" + "---|" * (3 + len(bands)))
        for r in rep.rows:
            cells = []
            for b in bands:
                cells.append(f"{_f(r.ttft_s.get(b), '{:.2f}')} / "
                             f"{_f(r.prefill_ms_per_token.get(b), '{:.3f}')} / "
                             f"{_f(r.decode_tok_s_by_band.get(b))}")
            out.append(f"| {r.upstream} | {r.model} | {r.precision} | " + " | ".join(cells) + " |")
        out.append("")
    notes = ["Medians from phasewatch's histograms (source: " + (rep.source or "metrics") + ")."]
    srcs = {r.prefill_source for r in rep.rows if r.prefill_source}
    if srcs:
        notes.append("Prefill ms/token = 1000 / median prefill tok/s ("
                     + ", ".join(f"source={s}" for s in sorted(srcs))
                     + "; proxy-side prefill includes any engine-side queueing).")
    if rep.power:
        notes.append("J/tok = decode-window watts / decode tok/s (one stream); power saving compares "
                     "decode-window watts.")
    else:
        notes.append("Power: n/a (phasewatch is not sampling GPU power here).")
    notes.append("Speed-ups and savings are against the bf16/fp16 row of the same upstream and "
                 "model family.")
    out.extend("- " + n for n in notes)
    return "\n".join(out) + "\n"


def to_json(rep: Report) -> str:
    return json.dumps(rep.as_dict(), indent=2, sort_keys=False)


def run(args) -> int:
    import httpx

    try:
        samples = load(args.source, args.window)
    except (httpx.HTTPError, ValueError) as exc:
        print(f"phasewatch report: cannot read {args.source}: {exc}", file=sys.stderr)
        return 1
    rep = build(samples, source=args.source)
    sys.stdout.write(to_json(rep) + "\n" if args.format == "json" else markdown(rep))
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--from", dest="source", default="http://127.0.0.1:8090",
                        help="phasewatch base or /metrics URL, or a Prometheus server URL "
                        "[default http://127.0.0.1:8090].")
    parser.add_argument("--format", choices=("markdown", "json"), default="markdown",
                        help="Output format [default markdown].")
    parser.add_argument("--window", default=None,
                        help="With a Prometheus server: only traffic of the last WINDOW "
                        "(a PromQL duration such as 15m or 1h); default: everything since start.")
