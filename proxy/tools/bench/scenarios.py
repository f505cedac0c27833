"""One model's scenarios: warm-up, idle power, decode, prefill / TTFT at each prompt
size, the concurrency sweep; each run repeated, the median and the runs' range kept."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field

from ...engines.llamacpp import file_label
from ...measure.precision import from_name
from .client import BenchError, Client
from .power import idle_watts, phasewatch_samples, settled_run
from .progress import Progress
from .prompts import Prompts
from .stats import stats
from .traffic import Watch


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


#: Most extra prefill runs (power only) the bench adds when each is too short for the GPU
#: power sensor.
EXTRA_PREFILLS = 20


@dataclass
class ModelResult:
    model: str
    precision: str = "unknown"
    quant: str = ""
    precision_source: str = "none"
    token_counting: str = ""
    decode: dict = field(default_factory=dict)
    prefill: list = field(default_factory=list)
    concurrency: list = field(default_factory=list)
    power: dict = field(default_factory=dict)
    baseline: str | None = None
    decode_speedup: float | None = None
    prefill_speedup: float | None = None
    power_saving: float | None = None
    notes: list = field(default_factory=list)
    #: Other traffic seen during each scenario's runs: {"decode": ["run 2: ..."], ...}
    other_traffic: dict = field(default_factory=dict)
    #: Where the model's time went, seconds: warm-up, idle, decode, prefill, sweep, prompts.
    seconds: dict = field(default_factory=dict)


def _decode_unresolved(shots: list, shortest: float | None) -> str:
    """Why decode W and J/tok are "—": each decode run was too short for the sensor."""
    decode_s = _median(s.decode_s for s in shots)
    lasted = f"decode lasted {decode_s:.2f} s" if decode_s is not None else "decode"
    resolves = (
        f" < {shortest:.2g} s the GPU power sensor resolves"
        if shortest
        else (", shorter than the GPU power sensor resolves")
    )
    return (
        f"decode W and J/tok: n/a, {lasted}{resolves} (no run's decode window resolved; "
        "a longer --decode-tokens gives one)"
    )


class _Clock:
    """Adds up where a model's bench time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, what: str, seconds: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + seconds


async def bench_model(
    client: Client, model: str, meta: dict, opts, progress: Progress, seed: int
) -> ModelResult:
    # a GGUF listed by its local path (llama-server without -a) is named by its file, as
    # phasewatch labels it; requests still name the model as the engine lists it
    label = file_label(model)
    res = ModelResult(label)
    clock = _Clock()
    t_model = time.monotonic()
    info = meta.get("phasewatch", {}).get(label) or meta.get("phasewatch", {}).get(model)
    if info:
        res.precision, res.quant, res.precision_source = info
    else:
        p = from_name(model) or (
            from_name(meta["roots"][model]) if meta["roots"].get(model) else None
        )
        if p is not None:
            res.precision, res.quant, res.precision_source = p.precision, p.quant, "name"
    prompts = Prompts(client, model, seed)
    await prompts.setup()
    limit = prompts.max_model_len or meta["max_len"].get(model)
    watch = Watch(client.http, client.own, label)

    # warm-up, also checking our token counting against the engine's usage
    for _ in range(max(1, opts.warmup)):
        text, counted = await prompts.make(opts.decode_prompt)
        t0 = time.monotonic()
        shot = await client.shot(model, text, 16)
        clock.add("warm-up", time.monotonic() - t0)
        await prompts.check(shot.prompt_tokens, counted)
        progress.step(f"{label}: warm-up")
    res.token_counting = prompts.method

    # idle power: a pause with nothing sent, the GPU's idle samples over it
    if meta["power"] and opts.idle_seconds > 0:
        t0 = time.monotonic()
        before = idle_watts(await phasewatch_samples(client), label)
        await asyncio.sleep(opts.idle_seconds)
        after = idle_watts(await phasewatch_samples(client), label)
        if before is not None and after is not None and after[1] > before[1]:
            res.power["idle_watts"] = (after[0] - before[0]) / (after[1] - before[1])
            res.power["idle_source"] = (
                f"phasewatch_gpu_power_sample_watts{{state=idle}} over a {opts.idle_seconds:g} s "
                "pause before the runs"
            )
        elif after is not None:
            res.notes.append(
                f"idle power: no idle sample in the {opts.idle_seconds:g} s pause (the GPU was "
                "busy with other work, or samples come less often)"
            )
        clock.add("idle", time.monotonic() - t0)

    await watch.begin()

    async def measured(scenario: str, run: int, coro, check: bool = True):
        result, seen = await watch.during(coro, check)
        if seen:
            res.other_traffic.setdefault(scenario, []).append(f"run {run}: {seen}")
        return result

    # decode: short prompt, long output
    shots, watts = [], []
    for i in range(opts.repeat):
        text, _ = await prompts.make(opts.decode_prompt)
        t0 = time.monotonic()
        shots.append(await measured("decode", i + 1, client.shot(model, text, opts.decode_tokens)))
        clock.add("decode", time.monotonic() - t0)
        if meta["power"]:
            w, n, _ = await settled_run(watch, label, "decode")
            if n > 0:
                watts.append(w)
            if n > 1:
                res.other_traffic.setdefault("decode", []).append(
                    f"run {i + 1}: {n:.0f} decode-power figures for 1 request"
                )
        progress.step(f"{label}: decode run {i + 1}/{opts.repeat}")
    tok = stats(s.decode_tok_s for s in shots)
    res.decode = {
        "prompt_tokens": _median(s.prompt_tokens for s in shots),
        "completion_tokens": _median(s.completion_tokens for s in shots),
        "tok_s": tok["median"] if tok else None,
        "tok_s_stats": tok,
        "ttft_s": _median(s.ttft_s for s in shots),
        "runs_tok_s": [round(s.decode_tok_s, 3) if s.decode_tok_s else None for s in shots],
    }
    if any((s.completion_tokens or 0) < opts.decode_tokens for s in shots):
        res.notes.append("decode: some answers stopped early (the engine ignored ignore_eos)")
    dw = stats(watts)
    if meta["power"] and dw is None:
        res.notes.append(_decode_unresolved(shots, meta.get("min_phase")))
    if dw is not None:
        jpt = stats(wt / s.decode_tok_s for wt, s in zip(watts, shots) if s.decode_tok_s and wt)
        res.power.update(
            {
                "decode_watts": dw["median"],
                "decode_watts_stats": dw,
                "joules_per_token": jpt["median"] if jpt else None,
                "joules_per_token_stats": jpt,
                "source": "phasewatch_gpu_power_watts{phase=decode} of each decode run",
            }
        )

    # prefill / TTFT
    prefill_watts: list[float] = []
    # each run's prefill energy and time: runs too short for the sensor add up to a
    # window it resolves (back-to-back repeats)
    prefill_joules: list[tuple[float, float]] = []
    for size in opts.prompt_tokens:
        if limit and size >= limit - 1:
            res.notes.append(f"prefill: {size}-token prompt skipped (max_model_len {limit})")
            for _ in range(opts.repeat):
                progress.step(f"{label}: prefill {size} skipped")
            continue
        shots = []
        try:
            for i in range(opts.repeat):
                text, _ = await prompts.make(size)
                t0 = time.monotonic()
                # each run's power needs the page after it; else the size's last run will do
                check = meta["power"] or i == opts.repeat - 1
                shots.append(
                    await measured(f"prefill {size}", i + 1, client.shot(model, text, 1), check)
                )
                clock.add("prefill", time.monotonic() - t0)
                if meta["power"]:
                    w, n, joules = await settled_run(watch, label, "prefill")
                    if n > 0:
                        prefill_watts.append(w)
                    elif joules > 0 and shots[-1].ttft_s:
                        prefill_joules.append((joules, shots[-1].ttft_s))
                progress.step(f"{label}: prefill ~{size} tokens run {i + 1}/{opts.repeat}")
        except BenchError as exc:
            if "HTTP 400" not in str(exc):
                raise
            # most likely longer than the context the engine gives a request
            res.notes.append(
                f"prefill: {size}-token prompt refused by the engine ({str(exc)[:200]})"
            )
            for _ in range(opts.repeat - len(shots)):
                progress.step(f"{label}: prefill {size} refused")
            continue
        counted_median = _median(s.prompt_tokens for s in shots)
        if counted_median is not None and abs(counted_median - size) > 0.05 * size:
            res.notes.append(
                f"prefill: asked for {size} prompt tokens, the engine counted {counted_median:.0f} "
                "(a truncated context, or the estimate is off)"
            )
        ttft = stats(s.ttft_s for s in shots)
        mspt = stats(
            s.ttft_s * 1000 / s.prompt_tokens
            for s in shots
            if s.prompt_tokens and s.ttft_s is not None
        )
        res.prefill.append(
            {
                "target_tokens": size,
                "prompt_tokens": counted_median,
                "ttft_s": ttft["median"] if ttft else None,
                "ttft_s_stats": ttft,
                "ms_per_token": mspt["median"] if mspt else None,
                "ms_per_token_stats": mspt,
                "tok_s": _median(
                    s.prompt_tokens / s.ttft_s for s in shots if s.prompt_tokens and s.ttft_s
                ),
                "runs_ttft_s": [round(s.ttft_s, 4) for s in shots if s.ttft_s is not None],
            }
        )

    # each prefill too short for the GPU power sensor: more back-to-back runs of the
    # longest prompt, for power only, until they add up to twice what it resolves
    shortest = meta.get("min_phase")
    extra = 0
    while (
        meta["power"]
        and not prefill_watts
        and prefill_joules
        and shortest is not None
        and sum(t for _, t in prefill_joules) < 2 * shortest
        and extra < EXTRA_PREFILLS
    ):
        size = max(p["target_tokens"] for p in res.prefill)
        text, _ = await prompts.make(size)
        extra += 1
        shot = await measured(f"prefill {size}", opts.repeat + extra, client.shot(model, text, 1))
        _, n, joules = await settled_run(watch, label, "prefill")
        if joules > 0 and shot.ttft_s:
            prefill_joules.append((joules, shot.ttft_s))
    pw_stats = stats(prefill_watts)
    if pw_stats:
        res.power["prefill_watts"] = pw_stats["median"]
        res.power["prefill_watts_stats"] = pw_stats
    elif prefill_joules:
        seconds = sum(t for _, t in prefill_joules)
        if shortest is not None and seconds >= shortest:
            res.power["prefill_watts"] = sum(j for j, _ in prefill_joules) / seconds
            res.notes.append(
                f"prefill W: each prefill was shorter than the GPU power sensor resolves "
                f"({shortest:.2g} s); from the energy of {len(prefill_joules)} back-to-back "
                f"runs ({seconds:.2g} s in all"
                + (f", {extra} of them extra runs for power only)" if extra else ")")
            )
        else:
            res.notes.append(
                f"prefill W: n/a, {len(prefill_joules)} prefills of {seconds:.2g} s in all "
                f"are shorter than the GPU power sensor resolves"
                + (f" ({shortest:.2g} s)" if shortest is not None else "")
            )

    # concurrency sweep
    for level in opts.concurrency:
        runs = []
        for i in range(opts.repeat):
            # the level's prompts are made together, before the run (never during one)
            made = await asyncio.gather(*(prompts.make(opts.sweep_prompt) for _ in range(level)))
            texts = [t for t, _ in made]

            async def sweep(texts=texts):
                t0 = time.perf_counter()
                shots = await asyncio.gather(
                    *(client.shot(model, t, opts.sweep_tokens) for t in texts)
                )
                return t0, shots

            t_run = time.monotonic()
            t0, shots = await measured(
                f"{level} at once", i + 1, sweep(), check=i == opts.repeat - 1
            )
            clock.add("sweep", time.monotonic() - t_run)
            wall = max(s.t_end for s in shots) - t0
            tokens = sum(s.completion_tokens or s.content_events for s in shots)
            runs.append(
                {
                    "aggregate_tok_s": tokens / wall,
                    "per_stream_tok_s": _median(s.decode_tok_s for s in shots),
                    "ttft_s": _median(s.ttft_s for s in shots),
                }
            )
            progress.step(f"{label}: {level} concurrent run {i + 1}/{opts.repeat}")
        agg = stats(r["aggregate_tok_s"] for r in runs)
        res.concurrency.append(
            {
                "concurrency": level,
                "aggregate_tok_s": agg["median"] if agg else None,
                "aggregate_tok_s_stats": agg,
                "per_stream_tok_s": _median(r["per_stream_tok_s"] for r in runs),
                "per_stream_tok_s_stats": stats(r["per_stream_tok_s"] for r in runs),
                "ttft_s": _median(r["ttft_s"] for r in runs),
            }
        )
    clock.add("prompts", prompts.seconds)
    measured_s = sum(clock.seconds.values())
    clock.add("other", max(0.0, time.monotonic() - t_model - measured_s))
    res.seconds = {k: round(v, 2) for k, v in clock.seconds.items()}
    res.seconds["tokenizer_calls"] = prompts.calls
    return res
