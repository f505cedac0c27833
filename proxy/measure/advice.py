"""Which phase to tune, from phasewatch's own measurements: per upstream x model x
precision, the workload's shape, where wall time and energy go, the formula
``total ~ prompt / prefill tok/s + output / decode tok/s`` checked against the measured
totals, and the levers ordered by what they would save on this traffic.

Pure: samples (a ``/metrics`` page, a Prometheus server's answers, or the proxy's own
registry) and the :class:`~proxy.measure.summary.Report` built from them in, rows out.
``phasewatch advise``, the ``report`` section, the status page's panel and
``GET /phasewatch/api/advice`` all render these rows; none computes its own.

Honest edges: a row with fewer than :data:`MIN_REQUESTS` measured requests gets no
levers; a lever needs its own figures measured on at least that many requests; every
lever says how many requests its figures rest on and whether its effect was measured here
(another precision of the same family served beside it) or is a typical range. Quality
trade-offs are outside what phasewatch measures, and say so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .metrics import BATCH_BANDS
from .summary import (
    BAND_TITLES,
    BASELINES,
    MIN_FIGURE_REQUESTS,
    PRECISION_ORDER,
    PREFILL_COMPARE,
    Report,
    Row,
    Samples,
    _gpus_of,
    hist,
)

#: Measured requests a row needs before it gets levers: a few dozen of one shape.
MIN_REQUESTS = 30
#: A phase below this share of the wall time gets no lever of its own.
MIN_SHARE = 0.05
#: Typical decode speed-ups from a 16-bit baseline, where no lower precision of the same
#: family is served beside it to measure (prefill moves far less: ~1.2-1.5x to INT4).
TYPICAL_DECODE = {"fp8": (1.8, 2.0), "int4": (2.5, 3.5)}
TYPICAL_PREFILL_INT4 = (1.2, 1.5)
#: 16-bit KV-cache element types (an FP8 cache halves their bytes per token).
_KV_16BIT = ("bf16", "fp16", "f16", "auto", "float16", "bfloat16")
QUALITY = "a quality trade-off outside what phasewatch measures: check it on your own evaluations"
WORKLOADS = ("interactive chat", "document analysis", "coding agents", "batch")
PHASES = ("queue", "prefill", "decode")
#: A batch band's typical batch (its bounds' middle): per-stream rate x this = in all.
BATCH_SIZE = {"1": 1, "2": 2, "3-4": 3.5, "5-8": 6.5, "9-16": 12.5, "17-32": 24.5, "33-64": 48.5}
BATCH_SIZE["65+"] = 65
#: Requests a batch band needs before its rate counts as evidence (the figures' minimum).
MIN_BATCH_REQUESTS = MIN_FIGURE_REQUESTS
#: One stream's decode rate at a larger batch, as a share of its rate at a smaller one, at
#: or above which decode is memory-bound here: each added stream adds nearly its own rate.
MEMORY_BOUND = 0.8


@dataclass
class Effect:
    """What a lever would save, per request (seconds of wall time, or of TTFT where
    ``ttft`` says so) and per generated token (joules at decode load)."""

    seconds: float | None = None
    ttft: bool = False  # the seconds come off time to first token
    joules_per_token: float | None = None
    summary: str = ""


@dataclass
class Lever:
    lever: str  # shorter_prompts | prefix_caching | queueing | lower_precision | fp8_kv_cache
    phase: str  # queue | prefill | decode
    title: str
    evidence: str  # the numbers, and how many requests they rest on
    requests: float  # the requests the evidence rests on
    expected_effect: Effect
    measured: bool  # measured on this traffic (False: a typical range, expected)
    caveat: str = ""


@dataclass
class AdviceRow:
    upstream: str
    model: str
    precision: str
    requests: float  # requests measured in full (outcome ok)
    enough: bool  # enough traffic to speak
    workload: str | None = None
    workload_evidence: str = ""
    prompt_tokens_median: float | None = None
    completion_tokens_median: float | None = None
    dominant_phase: str | None = None
    shares: dict[str, float] | None = None  # queue / prefill / decode of wall time
    seconds: dict[str, float] = field(default_factory=dict)  # mean per request, by phase
    formula: dict | None = None
    energy: dict = field(default_factory=dict)
    batching: dict = field(default_factory=dict)  # decode rates by in-flight batch
    levers: list[Lever] = field(default_factory=list)
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _n(name: str) -> str:
    return "phasewatch_" + name


def _fmt_n(v: float) -> str:
    return f"{v:,.0f}"


def _s(v: float) -> str:
    return f"{v:.2f} s" if v < 10 else f"{v:.1f} s"


def advise(samples: Samples, report: Report, min_requests: int = MIN_REQUESTS) -> list[AdviceRow]:
    """One row per row of `report` with a measured figure or a complete answer, in its
    order (a model that only had errors has nothing to advise on: the report names it)."""
    rows_per_upstream: dict[str, int] = {}
    for r in report.rows:
        rows_per_upstream[r.upstream] = rows_per_upstream.get(r.upstream, 0) + 1
    return [
        _row(samples, report, r, rows_per_upstream, min_requests)
        for r in report.rows
        if r.measured or samples.total(_n("requests_total"), **_labels(r), outcome="ok")
    ]


def _labels(r: Row) -> dict:
    return {"upstream": r.upstream, "model": r.model, "precision": r.precision}


def _row(
    samples: Samples,
    report: Report,
    r: Row,
    rows_per_upstream: dict[str, int],
    min_requests: int,
) -> AdviceRow:
    lab = _labels(r)
    ok = samples.total(_n("requests_total"), **lab, outcome="ok")
    out = AdviceRow(r.upstream, r.model, r.precision, ok, ok >= min_requests)

    prompt_h = hist(samples, _n("prompt_tokens"), **lab)
    completion_h = hist(samples, _n("completion_tokens"), **lab)
    out.prompt_tokens_median = prompt_h.quantile(0.5)
    out.completion_tokens_median = completion_h.quantile(0.5)
    ttft_n = hist(samples, _n("ttft_seconds"), **lab).count
    out.workload, out.workload_evidence = _workload(
        out.prompt_tokens_median, out.completion_tokens_median, ttft_n, prompt_h.count
    )

    # --- where wall time goes ---------------------------------------------------------
    queue = hist(samples, _n("queue_seconds"), **lab, where="proxy")
    up_queue = hist(samples, _n("queue_seconds"), **lab, where="upstream")
    pre_src = (
        "engine" if hist(samples, _n("prefill_seconds"), **lab, source="engine").count else "proxy"
    )
    pre = hist(samples, _n("prefill_seconds"), **lab, source=pre_src)
    dec_src = (
        "proxy" if hist(samples, _n("decode_seconds"), **lab, source="proxy").count else "engine"
    )
    dec = hist(samples, _n("decode_seconds"), **lab, source=dec_src)
    queue_s = queue.sum
    prefill_s = pre.sum
    queue_note = "proxy admission queue"
    moved = 0.0
    if up_queue.count:
        queue_s += up_queue.sum
        queue_note += " + engine-side wait (TTFT window minus the engine's prefill time)"
    elif pre_src == "proxy":
        # the proxy's prefill window includes the engine's queue: the engine's own
        # queue histogram (vLLM request_queue_time_seconds) moves it where it belongs
        eq = hist(samples, _n("engine_queue_seconds"), **lab)
        if eq.count:
            moved = min(eq.sum, prefill_s)
            queue_s += moved
            prefill_s -= moved
            queue_note += " + the engine's own queue time"
    total = queue_s + prefill_s + dec.sum
    if total > 0 and (pre.count or dec.count):
        out.shares = {
            "queue": queue_s / total,
            "prefill": prefill_s / total,
            "decode": dec.sum / total,
        }
        out.dominant_phase = max(PHASES, key=lambda p: out.shares[p])  # type: ignore[index]
    per_req = max(pre.count, dec.count, 1.0)
    out.seconds = {
        "queue": queue_s / max(queue.count, per_req),
        "prefill": prefill_s / pre.count if pre.count else 0.0,
        "decode": dec.sum / dec.count if dec.count else 0.0,
    }
    out.seconds["total"] = sum(out.seconds.values())

    # --- the formula, checked -----------------------------------------------------------
    pre_rate_h = hist(samples, _n("prefill_tokens_per_second"), **lab, source=pre_src)
    prefill_rate = pre_rate_h.quantile(0.5) if pre_rate_h.count else None
    decode_rate = r.decode_tok_s
    prefill_tokens = samples.total(_n("tokens_total"), **lab, phase="prefill")
    cached_tokens = samples.total(_n("tokens_total"), **lab, phase="cached")
    mean_processed = prefill_tokens / prompt_h.count if prompt_h.count else None
    if moved and mean_processed and prefill_s > 0:
        # the per-request rates include the engine's queue: tokens over queue-free time
        prefill_rate = mean_processed * pre.count / prefill_s
    mean_output = completion_h.mean()
    req_h = hist(samples, _n("request_seconds"), **lab, outcome="ok")
    if prefill_rate and decode_rate and mean_processed is not None and mean_output is not None:
        predicted = mean_processed / prefill_rate + max(0.0, mean_output - 1) / decode_rate
        measured = out.seconds["prefill"] + out.seconds["decode"]
        out.formula = {
            "prompt_tokens": mean_processed,
            "output_tokens": mean_output,
            "prefill_tok_s": prefill_rate,
            "decode_tok_s": decode_rate,
            "predicted_s": predicted,
            "measured_s": measured,
            "ratio": measured / predicted if predicted else None,
            "request_s": req_h.mean(),
            "requests": min(pre_rate_h.count, r.decode_samples or 0.0),
        }

    out.energy = _energy(samples, r, rows_per_upstream)
    out.batching = _batching(samples, lab)

    if not out.enough:
        out.dominant_phase = None  # the shares are figures; a verdict needs more traffic
        out.note = (
            f"only {ok:.0f} measured requests: advice needs at least {min_requests} "
            "of one shape, so none is given yet"
        )
        return out
    if out.shares is None:
        out.note = "no phase timings measured (unstreamed answers from an engine that reports none)"
        return out

    levers: list[Lever] = []
    share = out.shares
    silent: dict[str, str] = {}  # phase -> why it has no lever
    if share["queue"] >= MIN_SHARE and queue.count + up_queue.count:
        levers.append(_queueing(out, r, queue.count or up_queue.count, queue_note))
    if share["prefill"] >= MIN_SHARE:
        if prefill_rate and pre_rate_h.count >= min_requests:
            levers += _prefill_levers(
                out, prefill_rate, pre_rate_h.count, prefill_tokens, cached_tokens
            )
        else:
            silent["prefill"] = (
                f"prefill rates measured on {pre_rate_h.count:.0f} streamed requests "
                f"({min_requests} needed)"
            )
    if share["decode"] >= MIN_SHARE:
        if decode_rate and (r.decode_samples or 0) >= min_requests:
            levers += _precision_levers(out, r, report, min_requests)
            batching = _batching_lever(out, r)
            if batching is not None:
                levers.append(batching)
            elif not any(lv.phase == "decode" for lv in levers):
                silent["decode"] = _batching_silence(out)
        else:
            silent["decode"] = (
                f"decode rates measured on {r.decode_samples or 0:.0f} streamed requests "
                f"({min_requests} needed)"
            )
    kv = _kv_lever(samples, lab, r)
    if kv is not None:
        levers.append(kv)
    # the dominant phase's levers first, then by the seconds per request they would save
    dominant = out.dominant_phase
    levers.sort(key=lambda lv: (lv.phase != dominant, -(lv.expected_effect.seconds or 0.0)))
    out.levers = levers
    if not levers:
        out.note = "no lever has evidence on this traffic" + (
            ": " + "; ".join(silent.values()) if silent else ""
        )
    elif dominant in silent:
        out.note = (
            f"{dominant}, the dominant phase ({share[dominant]:.0%} of wall time), has no "
            f"lever: {silent[dominant]}"
        )
    return out


def _workload(
    prompt: float | None, completion: float | None, streamed: float, requests: float
) -> tuple[str | None, str]:
    """The workload table's name for this traffic's shape (medians)."""
    if prompt is None or completion is None or not requests:
        return None, "no token counts measured"
    shape = f"median prompt {_fmt_n(prompt)} tokens, median answer {_fmt_n(completion)} tokens"
    if streamed < 0.5 * requests:
        return "batch", shape + f"; {streamed:.0f} of {requests:.0f} answers streamed"
    if prompt >= 8000 and completion * 8 <= prompt:
        return "document analysis", shape
    if prompt < 2048:
        return "interactive chat", shape
    if completion * 8 <= prompt:
        return "document analysis", shape
    return "coding agents", shape


def _queueing(out: AdviceRow, r: Row, n: float, how: str) -> Lever:
    wait = out.seconds["queue"]
    share = out.shares["queue"] if out.shares else 0.0
    return Lever(
        "queueing",
        "queue",
        "capacity: fewer requests at once per engine, or another replica",
        f"requests waited {_s(wait)} on average before work began ({share:.0%} of wall time; "
        f"{how}), over {n:.0f} requests; {r.in_flight:.0f} in flight, {r.queued:.0f} "
        "queued at the proxy now",
        n,
        Effect(
            seconds=wait,
            ttft=True,
            summary=f"up to {_s(wait)} of TTFT per request with capacity for the offered "
            "concurrency (--max-concurrency bounds the wait; a second replica halves the load)",
        ),
        measured=True,
    )


def _prefill_levers(
    out: AdviceRow, rate: float, n: float, processed: float, cached: float
) -> list[Lever]:
    """Shorter prompts and a cacheable prefix. Their effect on this traffic is a share of
    its mean prefill time (prefill time grows with the prompt, so halving every prompt
    saves about half of it; mixed traffic is carried by its long prompts, which the
    median alone would hide), with the median prompt's own figure beside it."""
    median = out.prompt_tokens_median or 0.0
    share = out.shares["prefill"] if out.shares else 0.0
    mean_prefill = out.seconds["prefill"]
    half = mean_prefill / 2
    half_median = median / 2 / rate
    levers = [
        Lever(
            "shorter_prompts",
            "prefill",
            "shorter prompts or fewer retrieved chunks",
            f"median prompt {_fmt_n(median)} tokens, mean prefill {_s(mean_prefill)} at a "
            f"measured prefill rate of {_fmt_n(rate)} tok/s; prefill is {share:.0%} of wall "
            f"time; over {n:.0f} requests",
            n,
            Effect(
                seconds=half,
                ttft=True,
                summary=f"halving the prompts saves {_s(half)} of TTFT per request on this "
                f"traffic (halving the median prompt saves {_s(half_median)} of TTFT)",
            ),
            measured=True,
            caveat="the context the model loses is " + QUALITY,
        )
    ]
    total = processed + cached
    cached_share = cached / total if total else 0.0
    saves = mean_prefill / 4
    quarter_median = median / 4 / rate
    levers.append(
        Lever(
            "prefix_caching",
            "prefill",
            "a stable, cacheable prompt prefix (system prompt and instructions first, "
            "prefix caching on)",
            f"{cached_share:.0%} of prompt tokens came from the engine's prefix cache; "
            f"mean prefill {_s(mean_prefill)}; each 1,000 cached tokens saves "
            f"{1000 / rate:.2f} s at the measured {_fmt_n(rate)} tok/s; over {n:.0f} requests",
            n,
            Effect(
                seconds=saves,
                ttft=True,
                summary=f"a quarter of each prompt served from cache saves a quarter of the "
                f"prefill time, {_s(saves)} of TTFT per request on this traffic (a quarter of "
                f"the median prompt, {_fmt_n(median / 4)} tokens, saves {_s(quarter_median)})",
            ),
            measured=cached > 0,
            caveat="how much of your prompts is really shared is not something phasewatch "
            "can see: the quarter is an assumption",
        )
    )
    return levers


def _rank(precision: str) -> int:
    return PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else 99


def _precision_levers(out: AdviceRow, r: Row, report: Report, min_requests: int) -> list[Lever]:
    """Lower precisions: measured against siblings of the same family on the same
    upstream, else the typical ranges (from a 16-bit row only)."""
    levers = []
    decode_s, prefill_s = out.seconds["decode"], out.seconds["prefill"]
    served = [
        s
        for s in report.rows
        if s.upstream == r.upstream
        and s.family == r.family
        and s.key != r.key
        and _rank(s.precision) > _rank(r.precision)
        and s.precision != "unknown"
    ]
    siblings = [s for s in served if s.decode_tok_s and (s.decode_samples or 0) >= min_requests]
    # served beside it, but with too few streamed requests to measure against yet
    short = {s.precision: s for s in served if s not in siblings}
    for s in siblings:
        assert s.decode_tok_s and r.decode_tok_s
        speed = s.decode_tok_s / r.decode_tok_s
        pre_x, pre_band, pre_n = _prefill_ratio(r, s)
        saved = decode_s * (1 - 1 / speed) + (prefill_s * (1 - 1 / pre_x) if pre_x else 0.0)
        joules = None
        if r.joules_per_token_at_decode and s.joules_per_token_at_decode:
            joules = r.joules_per_token_at_decode - s.joules_per_token_at_decode
        ev = (
            f"{s.model} ({s.precision}) decodes at {s.decode_tok_s:.1f} tok/s against "
            f"{r.decode_tok_s:.1f} here: {speed:.2f}× measured, over "
            f"{s.decode_samples:.0f} and {r.decode_samples:.0f} requests"
        )
        if pre_x:
            band = BAND_TITLES.get(pre_band, pre_band)
            ev += f"; prefill {pre_x:.2f}× ({band} prompts, n={pre_n:.0f})"
        watts_n = min(r.decode_watts_samples, s.decode_watts_samples)
        if r.decode_watts and s.decode_watts and watts_n >= MIN_FIGURE_REQUESTS:
            ev += (
                f"; decode power {s.decode_watts:.0f} W against {r.decode_watts:.0f} W "
                f"({1 - s.decode_watts / r.decode_watts:.0%} less, n={watts_n:.0f}"
                + (
                    f", at batch {s.decode_batch} against {r.decode_batch}"
                    if s.decode_batch and r.decode_batch
                    else ""
                )
                + ")"
            )
        summary = f"{_s(saved)} less wall time per request ({speed:.2f}× decode)"
        if joules is not None:
            more = "less" if joules >= 0 else "more"
            summary += f", {abs(joules):.2f} J {more} per generated token at decode load"
        levers.append(
            Lever(
                "lower_precision",
                "decode",
                f"serve {s.precision}" + (f" ({s.quant})" if s.quant else "") + f": {s.model}",
                ev,
                min(s.decode_samples, r.decode_samples),
                Effect(seconds=saved, joules_per_token=joules, summary=summary),
                measured=True,
                caveat=QUALITY,
            )
        )
    measured = {s.precision for s in siblings}
    if r.precision in BASELINES:
        typical = [(p, rng) for p, rng in TYPICAL_DECODE.items() if p not in measured]
    elif r.precision in ("fp8", "int8") and "int4" not in measured:
        lo = TYPICAL_DECODE["int4"][0] / TYPICAL_DECODE["fp8"][1]
        hi = TYPICAL_DECODE["int4"][1] / TYPICAL_DECODE["fp8"][0]
        typical = [("int4", (lo, hi))]
    else:
        typical = []
    line = out.batching.get("fp8_energy_line")
    if line:
        for lv in levers:
            if lv.lever == "lower_precision" and "fp8" in lv.title:
                lv.evidence += f"; energy: {line}"
    for target, (lo, hi) in typical:
        saved = decode_s * (1 - 1 / lo)
        extra = ""
        if target == "int4" and r.precision in BASELINES:
            saved += prefill_s * (1 - 1 / TYPICAL_PREFILL_INT4[0])
            extra = f", prefill {TYPICAL_PREFILL_INT4[0]}–{TYPICAL_PREFILL_INT4[1]}×"
        more = f"; energy: {line}" if line and target == "fp8" else ""
        there = short.get(target)
        why = (
            f"{there.model} ({target}) is served here, but with {there.decode_samples:.0f} "
            f"streamed requests: measuring against it needs {min_requests}"
            if there is not None
            else f"no {target} of this family is served here to measure"
        )
        levers.append(
            Lever(
                "lower_precision",
                "decode",
                f"serve {target}" + (f": {there.model}" if there is not None else ""),
                f"{why}; decode {r.decode_tok_s:.1f} tok/s measured here over "
                f"{r.decode_samples:.0f} requests, {out.shares['decode'] if out.shares else 0:.0%} "
                f"of wall time; typical {r.precision} → {target}: {lo:.2f}–{hi:.2f}× decode{extra}"
                + more,
                r.decode_samples,
                Effect(
                    seconds=saved,
                    summary=f"about {_s(saved)} less wall time per request at the low end of "
                    f"the typical range ({lo:.2f}×); lower power too",
                ),
                measured=False,
                caveat=QUALITY,
            )
        )
    return levers


def _prefill_ratio(base: Row, other: Row) -> tuple[float | None, str, float]:
    """Prefill ms/token of `base` over `other`'s in the first prompt band both measured on
    at least MIN_FIGURE_REQUESTS requests: (ratio, band, the fewer requests), or None."""
    for band in PREFILL_COMPARE:
        ms, theirs = base.prefill_ms_per_token.get(band), other.prefill_ms_per_token.get(band)
        n = min(base.prefill_samples.get(band, 0), other.prefill_samples.get(band, 0))
        if ms and theirs and n >= MIN_FIGURE_REQUESTS:
            return ms / theirs, band, n
    return None, "", 0.0


def _kv_lever(samples: Samples, lab: dict, r: Row) -> Lever | None:
    """An FP8 KV cache, where KV-cache bytes limit concurrency: the engine preempted
    requests for want of cache, or fewer median requests fit than were in flight."""
    if r.kv_dtype not in _KV_16BIT or not r.kv_bytes_per_token:
        return None
    preempted = samples.total(_n("engine_preemptions_total"), **lab)
    fit = r.kv_fit_requests
    if fit is not None and r.engine_slots and fit >= r.engine_slots:
        fit = None  # the engine's slots bound concurrency here, not its KV cache
    busy = samples.total(_n("engine_requests_running"), **lab) + samples.total(
        _n("engine_requests_waiting"), **lab
    )
    if not preempted and not (fit is not None and busy > fit):
        return None
    ev = f"KV cache {r.kv_bytes_per_token:,.0f} B per token ({r.kv_dtype})"
    if fit is not None:
        ev += f"; {fit:,.0f} requests of the median length fit"
    if preempted:
        ev += f"; the engine preempted {preempted:.0f} requests for want of cache"
    if busy:
        ev += f"; {busy:.0f} running or waiting at the last scrape"
    return Lever(
        "fp8_kv_cache",
        "decode",
        "an FP8 KV cache (vLLM --kv-cache-dtype fp8; llama-server -ctk q8_0 -ctv q8_0)",
        ev,
        r.requests,
        Effect(
            summary="half the bytes per token: about twice the requests fit"
            + (f" ({fit:,.0f} → {2 * fit:,.0f})" if fit else "")
        ),
        measured=False,
        caveat=QUALITY,
    )


def _energy(samples: Samples, r: Row, rows_per_upstream: dict[str, int]) -> dict:
    """Where the row's GPU energy goes (idle / prefill / decode): from the per-phase
    energy counters where the power service exports them, else each state's share of the
    summed power samples (samples at a steady interval: the share of joules), for GPUs
    that serve this row alone; unavailable otherwise."""
    gpus, own = _gpus_of(samples, r.upstream, r.model)
    lab = {"upstream": r.upstream, "model": r.model, "precision": r.precision}
    phase = {
        p: samples.total(_n("request_phase_energy_joules_total"), **lab, phase=p)
        for p in ("prefill", "decode")
    }
    if phase["prefill"] + phase["decode"] > 0:
        # the per-phase energy counters (energy-counter deltas shared among the requests
        # in flight), and the GPUs' idle energy where the GPUs are this row's
        idle = None
        if gpus and (own or rows_per_upstream.get(r.upstream, 0) <= 1):
            idle = sum(samples.total(_n("gpu_idle_energy_joules_total"), **g) for g in gpus) or None
        joules = {"idle": idle or 0.0, **phase}
        total = sum(joules.values())
        out: dict = {
            "shares": {k: v / total for k, v in joules.items()},
            "basis": "energy counters",
            "requests": samples.total(_n("requests_total"), **lab, outcome="ok"),
            "joules": joules,
            "note": "per-phase energy from the GPUs' energy counters"
            + ("" if idle else "; idle energy not attributable to this row (counted as 0)"),
        }
        if r.decode_tokens:
            out["joules_per_token_decode"] = phase["decode"] / r.decode_tokens
        return out
    if not gpus:
        return {"shares": None, "note": "unavailable: GPU power is not sampled for this upstream"}
    if not own and rows_per_upstream.get(r.upstream, 0) > 1:
        return {
            "shares": None,
            "note": "unavailable: the upstream's GPUs serve several models "
            "(--power-gpu GPU=MODEL gives each its own)",
        }
    by_state = {}
    for state in ("idle", "prefill", "decode"):
        by_state[state] = sum(
            samples.total(_n("gpu_power_sample_watts_sum"), **g, state=state) for g in gpus
        )
    n = sum(
        samples.total(_n("gpu_power_sample_watts_count"), **g, state=s)
        for g in gpus
        for s in by_state
    )
    total = sum(by_state.values())
    if not total:
        return {"shares": None, "note": "unavailable: no power samples yet"}
    return {
        "shares": {k: v / total for k, v in by_state.items()},
        "basis": "power samples",
        "samples": n,
        "note": "share of the GPUs' sampled power by what was in flight (idle, prefill, "
        "decode); samples at a steady interval, so shares of energy",
    }


def _fp8_line(batch: str) -> str:
    """Which side of the FP8-versus-BF16 energy line a typical batch is on (FP8 can cost
    more energy per token than BF16 at batch 8-16, and less at 65 and beyond)."""
    size = BATCH_SIZE[batch]
    at = f"this traffic decodes at batch {batch}, "
    costs = "the 8–16 range where FP8 can cost more energy per token than BF16"
    if size < 8:
        return at + "below " + costs
    if size <= 16:
        return at + "inside " + costs
    if size < 65:
        return at + "between " + costs + " and 65+, where it costs less"
    return "this traffic decodes at batch 65+, where FP8 costs less energy per token than BF16"


def _batching(samples: Samples, lab: dict) -> dict:
    """Decode rates by the batch a request joined: per stream (measured) and in all (per
    stream x the band's typical batch), and the batch most decode time was spent at."""
    bands = {}
    for b in BATCH_BANDS:
        n = samples.total(_n("decode_batch_requests_total"), **lab, batch=b)
        sec = samples.total(_n("decode_batch_seconds_total"), **lab, batch=b)
        tok = samples.total(_n("decode_batch_tokens_total"), **lab, batch=b)
        if n and sec > 0:
            rate = tok / sec
            bands[b] = {
                "requests": n,
                "decode_seconds": sec,
                "tok_s_per_stream": rate,
                "tok_s_in_all": rate * BATCH_SIZE[b],
            }
    if not bands:
        return {}
    typical = max(bands, key=lambda b: bands[b]["decode_seconds"])
    return {"bands": bands, "typical": typical, "fp8_energy_line": _fp8_line(typical)}


def _batching_lever(out: AdviceRow, r: Row) -> Lever | None:
    """More concurrent streams per GPU, from the decode rates measured by batch (bands of
    MIN_BATCH_REQUESTS requests or more): where a larger batch than the one this traffic
    mostly runs at was measured to generate at least 1.2x the tokens per second in all;
    or, where this traffic already runs at its largest measured batch, where one stream's
    rate barely dropped from a smaller batch to it (MEMORY_BOUND): decode is memory-bound,
    so each stream added brings nearly its own rate."""
    b = out.batching
    if not b:
        return None
    bands = {k: v for k, v in b["bands"].items() if v["requests"] >= MIN_BATCH_REQUESTS}
    typical = b["typical"]
    if typical not in bands:
        return None
    now = bands[typical]
    bigger = [k for k in bands if BATCH_SIZE[k] > BATCH_SIZE[typical]]
    smaller = [k for k in bands if BATCH_SIZE[k] < BATCH_SIZE[typical]]
    if bigger:
        best = max(bigger, key=lambda k: bands[k]["tok_s_in_all"])
        lo, hi, lo_band, hi_band = now, bands[best], typical, best
        if hi["tok_s_in_all"] / lo["tok_s_in_all"] < 1.2:
            return None
    elif smaller:
        lo_band = min(smaller, key=lambda k: BATCH_SIZE[k])
        lo, hi, hi_band = bands[lo_band], now, typical
        if hi["tok_s_per_stream"] / lo["tok_s_per_stream"] < MEMORY_BOUND:
            return None  # compute-bound already: more streams slow each one down
    else:
        return None
    gain = hi["tok_s_in_all"] / lo["tok_s_in_all"]
    kept = hi["tok_s_per_stream"] / lo["tok_s_per_stream"]
    joules = None
    if r.decode_watts and r.decode_watts_samples >= MIN_FIGURE_REQUESTS:
        joules = r.decode_watts / lo["tok_s_in_all"] - r.decode_watts / hi["tok_s_in_all"]
    ev = (
        f"one stream decodes {lo['tok_s_per_stream']:.1f} tok/s at batch {lo_band} "
        f"({lo['requests']:.0f} requests) and {hi['tok_s_per_stream']:.1f} tok/s at batch "
        f"{hi_band} ({hi['requests']:.0f} requests): {1 - kept:.0%} slower per stream, "
        f"about {lo['tok_s_in_all']:.0f} → {hi['tok_s_in_all']:.0f} tok/s in all"
    )
    if hi_band == typical:
        summary = (
            f"decode is memory-bound here (one stream kept {kept:.0%} of its rate from batch "
            f"{lo_band} to {hi_band}, {gain:.1f}× the tokens per second in all): more "
            "concurrent streams per GPU should raise throughput further at little cost to "
            "each stream"
        )
        caveat = (
            f"measured up to batch {hi_band}, the batch this traffic mostly runs at; beyond "
            "it this holds while decode stays memory-bound, and the KV cache and the engine's "
            "slots bound it"
        )
    else:
        summary = f"about {gain:.1f}× the generated tokens per second from the same GPU"
        caveat = "each request's own decode gets somewhat slower"
    if joules is not None:
        summary += f", about {joules:.2f} J less per token"
    ev += f"; {b['fp8_energy_line']}"
    return Lever(
        "batching",
        "decode",
        "more concurrent streams per GPU (more parallel clients; the engine's --max-num-seqs "
        "or -np)",
        ev,
        lo["requests"] + hi["requests"],
        Effect(joules_per_token=joules, summary=summary),
        measured=True,
        caveat=caveat
        + (
            "; power at the larger batch is taken as the decode power measured overall (it "
            "rises a little with the batch)"
            if joules is not None
            else ""
        ),
    )


def _batching_silence(out: AdviceRow) -> str:
    """Why decode has no batching lever: which batch bands were measured on how many."""
    bands = (out.batching or {}).get("bands") or {}
    if not bands:
        return "no decode rates by batch measured"
    seen = ", ".join(f"batch {k}: {v['requests']:.0f}" for k, v in bands.items())
    enough = [k for k, v in bands.items() if v["requests"] >= MIN_BATCH_REQUESTS]
    if len(enough) < 2:
        return (
            f"how decode scales with the batch needs two batch bands of {MIN_BATCH_REQUESTS} "
            f"requests each ({seen} requests)"
        )
    return (
        f"decode rates by batch ({seen} requests) show no larger batch generating more "
        "in all, and one stream slowing as the batch grows"
    )
