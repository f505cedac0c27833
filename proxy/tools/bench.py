"""``phasewatch bench``: the benchmark methodology, driven against any OpenAI-compatible
endpoint.

For each model: a warm-up, then each scenario at least three times, the median reported:

- **decode**: a short prompt and a long answer (``ignore_eos`` so the length is fixed):
  decode tok/s = (completion_tokens - 1) / (last - first content event);
- **prefill / TTFT**: ~4K, ~8K and ~16K-token prompts with ``max_tokens`` 1: TTFT, and
  prefill ms/token = TTFT / prompt tokens (client-side, so it includes the HTTP round
  trip and any queueing, which a lone request on an idle engine keeps tiny);
- **concurrency sweep**: N requests at once (1, 2, 4, 8 by default): aggregate tok/s
  and the median per-stream decode rate.

Prompts have exact token lengths for the target model where the engine has a tokenizer
endpoint (vLLM and llama-server ``/tokenize``), checked against the ``usage`` of the
warm-up request; otherwise the length comes from a calibration of words to tokens on two
requests' ``usage``, and is reported as an estimate. Every prompt starts with different
words, so a prefix cache cannot serve a repetition. Timing is client-side: httpx
streaming, TTFT at the first event carrying non-empty content.

When the URL is a phasewatch proxy, the model's precision comes from its
``phasewatch_model_info`` and decode-window power from its ``phasewatch_gpu_power_watts``
(n/a when power is not sampled); otherwise precision is read from the model name.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from .. import __version__
from ..measure.precision import from_name
from ..measure.summary import BASELINES, Samples, model_family
from .bench_stats import cell, legacy_stats, num, size_label, spread, stats
from .bench_traffic import NAMES, POWER, Own, Watch

#: Common words that most tokenizers (Llama, Qwen, Mistral, GPT) keep as one token each
#: with their leading space, so word counts track token counts closely.
_VOCAB = (
    "the of and to in is was for on that with as by at from his her they this had not are "
    "but have one all were there when what your can said which their will each about how up "
    "out them then she many some so these would other into has more two like him see time "
    "could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through "
    "back much go good new write our me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take "
    "why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both "
    "few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life "
    "enough took sometimes four head above kind began almost live page got earth need far "
    "hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days paper hard near sentence better best "
    "across during today others however sure means knew try told young miles sun ways thing "
    "whole hear example heard several change answer room sea against top turned learn point "
    "city play toward five using himself usually"
).split()


class BenchError(Exception):
    pass


# --- one request ------------------------------------------------------------------------------


@dataclass
class Shot:
    """Client-side figures of one streamed request."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_events: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    decode_s: float | None = None
    decode_tok_s: float | None = None
    t_start: float = 0.0
    t_end: float = 0.0


def _has_output(obj: dict) -> bool:
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if isinstance(delta, dict) and (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            return True
    return False


class Client:
    """Streams chat completions and times them."""

    def __init__(self, url: str, api_key: str | None, timeout: float, ignore_eos: bool) -> None:
        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=256),
        )
        self.ignore_eos = ignore_eos
        self.own = Own()  # what the bench itself sent (to tell other traffic apart)

    async def aclose(self) -> None:
        await self.http.aclose()

    def body(self, model: str, prompt: str, max_tokens: int, stream: bool = True) -> dict:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos and max_tokens > 1:
            body["ignore_eos"] = True
        return body

    async def shot(self, model: str, prompt: str, max_tokens: int) -> Shot:
        self.own.start(max_tokens)
        try:
            return await self._shot(model, prompt, max_tokens)
        finally:
            self.own.end()

    async def _shot(self, model: str, prompt: str, max_tokens: int) -> Shot:
        s = Shot()
        s.t_start = t0 = time.perf_counter()
        t_last = None
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=self.body(model, prompt, max_tokens)
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:500]
                raise BenchError(f"{model}: HTTP {resp.status_code}: {text}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    continue  # read to the end: a hang-up here would count as an abort
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj:
                    raise BenchError(f"{model}: error in stream: {obj['error']}")
                if _has_output(obj):
                    if s.ttft_s is None:
                        s.ttft_s = now - t0
                        first = now
                    t_last = now
                    s.content_events += 1
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    s.prompt_tokens = usage.get("prompt_tokens", s.prompt_tokens)
                    s.completion_tokens = usage.get("completion_tokens", s.completion_tokens)
        s.t_end = time.perf_counter()
        s.total_s = s.t_end - t0
        if s.ttft_s is None:
            raise BenchError(f"{model}: the response carried no content")
        n = s.completion_tokens if s.completion_tokens is not None else s.content_events
        if n >= 2 and t_last is not None and t_last > first:
            s.decode_s = t_last - first
            s.decode_tok_s = (n - 1) / s.decode_s
        return s

    async def usage_prompt_tokens(self, model: str, prompt: str) -> int | None:
        self.own.start(1)
        try:
            resp = await self.http.post(
                "/v1/chat/completions", json=self.body(model, prompt, 1, stream=False)
            )
        finally:
            self.own.end()
        if resp.status_code != 200:
            raise BenchError(f"{model}: HTTP {resp.status_code}: {resp.text[:500]}")
        usage = resp.json().get("usage") or {}
        return usage.get("prompt_tokens")


# --- prompts of exact length -----------------------------------------------------------------


class Prompts:
    """Makes chat prompts of a given token length for one model."""

    def __init__(self, client: Client, model: str, seed: int) -> None:
        self.client = client
        self.model = model
        self.rng = random.Random(seed)
        self.kind = "none"  # vllm | llamacpp | calibrated | rough
        self.offset = 0  # usage.prompt_tokens - what our counting says (template, BOS)
        self.per_word = 1.0
        self.overhead = 0.0
        self.max_model_len: int | None = None
        self.fixed = 0.0  # tokens a prompt has besides its words (template, BOS)
        self.seconds = 0.0  # spent making prompts (tokenizer calls), wall time
        self._active, self._since = 0, 0.0
        self.calls = 0  # tokenizer calls

    @property
    def method(self) -> str:
        if self.kind in ("vllm", "llamacpp"):
            return "exact: the engine's /tokenize" + (
                f" (checked against usage, offset {self.offset:+d})"
                if self.offset
                else " (checked against usage)"
            )
        if self.kind == "calibrated":
            return (
                f"estimate: calibrated on usage ({self.per_word:.3f} tokens/word + "
                f"{self.overhead:.0f}), no tokenizer endpoint"
            )
        return "rough estimate: no tokenizer endpoint and no usage (1.3 tokens/word assumed)"

    def words(self, n: int) -> str:
        # a fresh random order per prompt: no two prompts share a prefix (no cache hits)
        return " ".join(self.rng.choice(_VOCAB) for _ in range(max(1, n)))

    async def setup(self) -> None:
        http = self.client.http
        try:
            resp = await http.post(
                "/tokenize",
                json={
                    "model": self.model,
                    "messages": [{"role": "user", "content": "hello world"}],
                },
            )
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("count"), int):
            self.kind = "vllm"
            self.max_model_len = data.get("max_model_len")
            return
        try:
            resp = await http.post("/tokenize", json={"content": "hello world"})
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            data = None
        if isinstance(data, dict) and isinstance(data.get("tokens"), list):
            self.kind = "llamacpp"
            try:  # the context a slot has (prompts beyond it are refused)
                props = (await http.get("/props")).json()
                n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx") or props.get(
                    "n_ctx"
                )
                if isinstance(n_ctx, int) and n_ctx > 0:
                    self.max_model_len = n_ctx
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            return
        # no tokenizer: two requests' usage give tokens per word and the template's overhead
        a, b = 64, 1024
        ta = await self.client.usage_prompt_tokens(self.model, self.words(a))
        tb = await self.client.usage_prompt_tokens(self.model, self.words(b))
        if ta and tb and tb > ta:
            self.kind = "calibrated"
            self.per_word = (tb - ta) / (b - a)
            self.overhead = ta - self.per_word * a
        else:
            self.kind, self.per_word, self.overhead = "rough", 1.3, 10.0

    async def count(self, text: str) -> int | None:
        self.calls += 1
        http = self.client.http
        if self.kind == "vllm":
            resp = await http.post(
                "/tokenize",
                json={"model": self.model, "messages": [{"role": "user", "content": text}]},
            )
            return resp.json()["count"] + self.offset
        if self.kind == "llamacpp":
            prompt = text
            try:  # the chat template's own tokens, where the server can apply it
                r = await http.post(
                    "/apply-template", json={"messages": [{"role": "user", "content": text}]}
                )
                if r.status_code == 200 and isinstance(r.json().get("prompt"), str):
                    prompt = r.json()["prompt"]
            except (httpx.HTTPError, ValueError):
                pass
            resp = await http.post("/tokenize", json={"content": prompt, "add_special": True})
            return len(resp.json()["tokens"]) + self.offset
        return None

    async def make(self, tokens: int) -> tuple[str, int]:
        """A prompt of `tokens` tokens (exact where countable) and its expected length."""
        if not self._active:  # wall time while any prompt is being made
            self._since = time.monotonic()
        self._active += 1
        try:
            return await self._make(tokens)
        finally:
            self._active -= 1
            if not self._active:
                self.seconds += time.monotonic() - self._since

    async def _make(self, tokens: int) -> tuple[str, int]:
        if self.kind not in ("vllm", "llamacpp"):
            n = max(1, round((tokens - self.overhead) / self.per_word))
            return self.words(n), tokens
        # count ~= fixed + per_word * words (the template's tokens, then the words'); both
        # are learnt from every count, so after the first prompts one call usually hits
        pool = [self.rng.choice(_VOCAB) for _ in range(int(tokens * 1.5) + 64)]
        n = max(1, min(len(pool), round((tokens - self.fixed) / self.per_word)))
        best: tuple[str, int] | None = None
        last: tuple[int, int] | None = None
        for _ in range(10):
            text = " ".join(pool[:n])
            got = await self.count(text)
            assert got is not None  # counting works for the engines with a tokenizer
            if best is None or abs(got - tokens) < abs(best[1] - tokens):
                best = (text, got)
            if got == tokens:
                break
            if last is not None and last[0] != n and got != last[1]:
                self.per_word = max(0.2, min(5.0, (got - last[1]) / (n - last[0])))
            self.fixed = got - self.per_word * n
            last = (n, got)
            guess = round((tokens - self.fixed) / self.per_word)
            if guess == n:
                guess += 1 if got < tokens else -1
            n = max(1, min(len(pool), guess))
        assert best is not None
        return best

    async def check(self, usage_tokens: int | None, counted: int) -> None:
        """Learn the difference between our count and the engine's usage (template, BOS)."""
        if usage_tokens is not None and self.kind in ("vllm", "llamacpp"):
            self.offset += usage_tokens - counted


# --- the benchmark -----------------------------------------------------------------------------


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class Progress:
    """One line per step, or a redrawn bar on a terminal."""

    def __init__(self, total: int, quiet: bool, stream=sys.stderr) -> None:
        self.total, self.done, self.quiet, self.stream = max(1, total), 0, quiet, stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if self.quiet:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s (eta {eta:4.0f}s) {what}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if not self.quiet:
            self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
            self.stream.flush()


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


async def _model_list(client: Client) -> list[dict]:
    try:
        resp = await client.http.get("/v1/models")
        data = resp.json().get("data", []) if resp.status_code == 200 else []
    except httpx.TransportError as exc:
        raise BenchError(f"cannot reach {client.base}: {exc}") from exc
    except (httpx.HTTPError, ValueError, AttributeError):
        data = []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _context_length(model: dict) -> int | None:
    """vLLM's max_model_len, or llama-server's meta.n_ctx, from a /v1/models entry."""
    for value in (
        model.get("max_model_len"),
        (model.get("meta") or {}).get("n_ctx") if isinstance(model.get("meta"), dict) else None,
    ):
        if isinstance(value, int) and value > 0:
            return value
    return None


#: The series the bench reads from phasewatch's page (the rest, the histograms' buckets
#: above all, is skipped unparsed: a busy client takes far longer to parse a whole page).
_POWER_SERIES = ("phasewatch_model_info", *POWER)


def _samples_of(text: str | None) -> Samples | None:
    """phasewatch's power series from a /metrics page; None for an engine's page (the
    simulator's has phasewatch_sim_* series of its own: only a proxy has model_info)."""
    if not text or "phasewatch_model_info" not in text:
        return None
    wanted = [ln for ln in text.splitlines() if ln.startswith(_POWER_SERIES)]
    try:
        return Samples.from_text("\n".join(wanted) + "\n")
    except ValueError:
        return None


async def _phasewatch_samples(client: Client) -> Samples | None:
    try:
        resp = await client.http.get("/metrics", params={"name[]": NAMES})
    except httpx.HTTPError:
        return None
    return _samples_of(resp.text) if resp.status_code == 200 else None


def _run_watts(watch: Watch, model: str, phase: str) -> tuple[float, float]:
    """Mean `phase` power of the requests counted during the last measured run, and how
    many requests it covers (the bench sent one)."""
    before = _decode_watts(_samples_of(watch.before_text), model, phase)
    after = _decode_watts(_samples_of(watch.text), model, phase)
    n = after[1] - before[1]
    return ((after[0] - before[0]) / n if n > 0 else 0.0), n


def _decode_watts(
    samples: Samples | None, model: str, phase: str = "decode"
) -> tuple[float, float]:
    """Sum and count of the per-request mean power of `phase` (decode or prefill)."""
    if samples is None:
        return 0.0, 0.0
    lab = {"model": model, "phase": phase}
    return (
        samples.total("phasewatch_gpu_power_watts_sum", **lab),
        samples.total("phasewatch_gpu_power_watts_count", **lab),
    )


def _idle_watts(samples: Samples | None, model: str) -> tuple[float, float] | None:
    """Sum and count of the power samples taken while the model's GPUs were idle: the
    GPUs given to the model (``--power-gpu GPU=MODEL``), else those of its upstream."""
    if samples is None:
        return None
    upstreams = {
        s.labels.get("upstream") for s in samples.get("phasewatch_model_info", model=model)
    }
    own, shared = [], []
    for s in samples.get("phasewatch_gpu_power_sample_watts_count", state="idle"):
        if s.labels.get("model") == model:
            own.append(s.labels)
        elif s.labels.get("model") in (None, "all") and upstreams & set(
            s.labels.get("upstream", "").split("+")
        ):
            shared.append(s.labels)
    gpus = own or shared
    if not gpus:
        return None
    total = count = 0.0
    for labels in gpus:
        lab = {k: v for k, v in labels.items() if k != "le"}
        total += samples.total("phasewatch_gpu_power_sample_watts_sum", **lab)
        count += samples.total("phasewatch_gpu_power_sample_watts_count", **lab)
    return total, count


class _Clock:
    """Adds up where a model's bench time goes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, what: str, seconds: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + seconds


async def bench_model(
    client: Client, model: str, meta: dict, opts, progress: Progress, seed: int
) -> ModelResult:
    res = ModelResult(model)
    clock = _Clock()
    t_model = time.monotonic()
    info = meta.get("phasewatch", {}).get(model)
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
    watch = Watch(client.http, client.own, model)

    # warm-up, also checking our token counting against the engine's usage
    for _ in range(max(1, opts.warmup)):
        text, counted = await prompts.make(opts.decode_prompt)
        t0 = time.monotonic()
        shot = await client.shot(model, text, 16)
        clock.add("warm-up", time.monotonic() - t0)
        await prompts.check(shot.prompt_tokens, counted)
        progress.step(f"{model}: warm-up")
    res.token_counting = prompts.method

    # idle power: a pause with nothing sent, the GPU's idle samples over it
    if meta["power"] and opts.idle_seconds > 0:
        t0 = time.monotonic()
        before = _idle_watts(await _phasewatch_samples(client), model)
        await asyncio.sleep(opts.idle_seconds)
        after = _idle_watts(await _phasewatch_samples(client), model)
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
            w, n = _run_watts(watch, model, "decode")
            if n > 0:
                watts.append(w)
            if n > 1:
                res.other_traffic.setdefault("decode", []).append(
                    f"run {i + 1}: {n:.0f} decode-power figures for 1 request"
                )
        progress.step(f"{model}: decode run {i + 1}/{opts.repeat}")
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
    for size in opts.prompt_tokens:
        if limit and size >= limit - 1:
            res.notes.append(f"prefill: {size}-token prompt skipped (max_model_len {limit})")
            for _ in range(opts.repeat):
                progress.step(f"{model}: prefill {size} skipped")
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
                    w, n = _run_watts(watch, model, "prefill")
                    if n > 0:
                        prefill_watts.append(w)
                progress.step(f"{model}: prefill ~{size} tokens run {i + 1}/{opts.repeat}")
        except BenchError as exc:
            if "HTTP 400" not in str(exc):
                raise
            # most likely longer than the context the engine gives a request
            res.notes.append(
                f"prefill: {size}-token prompt refused by the engine ({str(exc)[:200]})"
            )
            for _ in range(opts.repeat - len(shots)):
                progress.step(f"{model}: prefill {size} refused")
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

    pw_stats = stats(prefill_watts)
    if pw_stats:
        res.power["prefill_watts"] = pw_stats["median"]
        res.power["prefill_watts_stats"] = pw_stats

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
            progress.step(f"{model}: {level} concurrent run {i + 1}/{opts.repeat}")
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


def compare(results: list[ModelResult]) -> None:
    """Speed-ups and power saving against the bf16/fp16 model of the same family."""
    for r in results:
        fam = model_family(r.model)
        base = None
        for p in BASELINES:
            base = next(
                (b for b in results if b.precision == p and model_family(b.model) == fam), None
            )
            if base:
                break
        if base is None:
            continue
        r.baseline = f"{base.model} ({base.precision})"
        if r.decode.get("tok_s") and base.decode.get("tok_s"):
            r.decode_speedup = r.decode["tok_s"] / base.decode["tok_s"]
        mine = {p["target_tokens"]: p["ms_per_token"] for p in r.prefill}
        theirs = {p["target_tokens"]: p["ms_per_token"] for p in base.prefill}
        ratios = [theirs[k] / mine[k] for k in mine if mine[k] and theirs.get(k)]
        if ratios:
            r.prefill_speedup = statistics.median(ratios)
        if r.power.get("decode_watts") and base.power.get("decode_watts"):
            r.power_saving = 1.0 - r.power["decode_watts"] / base.power["decode_watts"]


#: Figures whose spread is checked, with the label a warning uses.
def _figures(m: dict):
    yield "decode tok/s", m["decode"].get("tok_s_stats")
    for p in m["prefill"]:
        yield f"prefill ms/tok {size_label(p['target_tokens'])}", p.get("ms_per_token_stats")
        yield f"TTFT {size_label(p['target_tokens'])}", p.get("ttft_s_stats")
    for c in m["concurrency"]:
        yield f"{c['concurrency']} at once tok/s", c.get("aggregate_tok_s_stats")
    yield "decode W", m["power"].get("decode_watts_stats")


def warnings(result: dict, max_spread: float) -> list[str]:
    """What makes a figure doubtful: runs that disagree, other traffic on the engine."""
    out = []
    for m in result["models"]:
        wide = []
        for label, st in _figures(m):
            sp = spread(st)
            if sp is not None and sp > max_spread and not label.startswith("TTFT"):
                wide.append(f"{label} {sp * 100:.0f}% ({num(st['min'])}–{num(st['max'])})")
        if wide:
            out.append(
                f"{m['model']} ({m['precision']}): runs differ by more than --max-spread "
                f"{max_spread * 100:.0f}% of their median: {', '.join(wide)}"
                + (
                    " (the TTFTs of the same runs alike)"
                    if any("prefill" in w for w in wide)
                    else ""
                )
                + "; more --repeat, or a quieter engine and client machine"
            )
    # other traffic: one warning for the whole bench, naming each scenario it touched
    busy = [
        f"the {scenario} runs of {m['model']} ({m['precision']}) ("
        + "; ".join(seen[:3])
        + (f"; {len(seen) - 3} more" if len(seen) > 3 else "")
        + ")"
        for m in result["models"]
        for scenario, seen in m.get("other_traffic", {}).items()
    ]
    if busy:
        out.append(
            "other traffic on the engine during "
            + ", ".join(busy)
            + ": those figures include that load (bench a quiet engine)"
        )
    return out


def runs_phrase(repetitions: int) -> str:
    """What each figure is: a median (min–max) of several runs, or a single run."""
    if repetitions == 1:
        return "one run per figure (no median, no spread: --repeat 3 for those)"
    return f"median (min–max) of {repetitions} runs"


async def run_bench(opts, progress_stream=sys.stderr) -> dict:
    client = Client(opts.url, opts.api_key, opts.timeout, not opts.no_ignore_eos)
    try:
        listed = await _model_list(client)
        models = opts.model or [m["id"] for m in listed]
        if not models:
            raise BenchError(f"no model given and {client.base}/v1/models lists none; pass --model")
        meta: dict[str, Any] = {
            "roots": {m["id"]: m.get("root") for m in listed if isinstance(m.get("root"), str)},
            "max_len": {m["id"]: _context_length(m) for m in listed if _context_length(m)},
            "phasewatch": {},
            "is_phasewatch": False,
        }
        if len(models) == 1 and models[0] not in meta["roots"]:
            try:  # llama-server names its GGUF file here (the precision is in it)
                props = (await client.http.get("/props")).json()
                if isinstance(props.get("model_path"), str):
                    meta["roots"][models[0]] = props["model_path"]
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        pw = await _phasewatch_samples(client)
        meta["power"] = False
        if pw is not None:
            meta["is_phasewatch"] = True
            # GPU power sampled: idle, prefill and decode watts are measured
            meta["power"] = pw.has("phasewatch_gpu_power_sample_watts_count") or pw.has(
                "phasewatch_gpu_power_watts_count"
            )
            for s in pw.get("phasewatch_model_info"):
                meta["phasewatch"][s.labels.get("model")] = (
                    s.labels.get("precision", "unknown"),
                    s.labels.get("quant", ""),
                    "phasewatch",
                )
        per_model = max(1, opts.warmup) + opts.repeat * (
            1 + len(opts.prompt_tokens) + len(opts.concurrency)
        )
        progress = Progress(per_model * len(models), opts.quiet, progress_stream)
        if opts.repeat < 3:
            progress.note(
                "note: --repeat 1: one run per figure, no median or spread"
                if opts.repeat == 1
                else f"note: {opts.repeat} runs per figure; medians need at least 3 to mean much"
            )
        started = time.time()
        results = []
        for i, model in enumerate(models):
            results.append(await bench_model(client, model, meta, opts, progress, opts.seed + i))
        compare(results)
        result = {
            "tool": f"phasewatch bench {__version__}",
            "url": client.base,
            "through_phasewatch": meta["is_phasewatch"],
            "started": started,
            "seconds": round(time.time() - started, 2),
            "repetitions": opts.repeat,
            "max_spread": opts.max_spread,
            "method": (
                "one run per figure"
                if opts.repeat == 1
                else "median of repetitions (min–max in brackets)"
            )
            + "; client-side timing (httpx "
            "streaming); TTFT at the first event carrying content; prefill ms/token = TTFT / "
            "prompt tokens",
            "models": [asdict(r) for r in results],
        }
        result["warnings"] = warnings(result, opts.max_spread)
        return result
    finally:
        await client.aclose()


# --- output -----------------------------------------------------------------------------------


def _f(v, fmt="{:.1f}", none="—"):
    return none if v is None else fmt.format(v)


def table(result: dict) -> str:
    models = result["models"]
    sizes = sorted({p["target_tokens"] for m in models for p in m["prefill"]})
    levels = sorted({c["concurrency"] for m in models for c in m["concurrency"]})
    power = any(m["power"] for m in models)
    na = "—" if power else "n/a"
    out = [
        f"phasewatch bench: {result['url']}, {runs_phrase(result['repetitions'])} "
        f"({result['seconds']:.0f} s)",
        "",
    ]
    head = ["model", "precision", "decode tok/s"]
    head += [f"prefill ms/tok {size_label(s)}" for s in sizes]
    head += [f"TTFT {size_label(s)}" for s in sizes]
    head += ["decode W", "idle W", "J/tok", "decode speed-up", "prefill speed-up", "power saving"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for m in models:
        pre = {p["target_tokens"]: p for p in m["prefill"]}
        prec = m["precision"] + (
            f" ({m['quant']})" if m["quant"] and m["quant"].lower() != m["precision"] else ""
        )
        d = m["decode"]
        cells = [m["model"], prec, cell(d.get("tok_s_stats") or legacy_stats(d.get("tok_s")))]
        cells += [
            cell(pre[s].get("ms_per_token_stats"), "{:.3f}") if s in pre else "—" for s in sizes
        ]
        cells += [
            cell(pre[s].get("ttft_s_stats"), "{:.2f}", " s") if s in pre else "—" for s in sizes
        ]
        pw = m["power"]
        cells += [
            cell(pw.get("decode_watts_stats"), "{:.0f}", none=na),
            _f(pw.get("idle_watts"), "{:.0f}", na),
            cell(pw.get("joules_per_token_stats"), "{:.2f}", none=na),
            _f(m["decode_speedup"], "{:.2f}×"),
            _f(m["prefill_speedup"], "{:.2f}×"),
            _f(None if m["power_saving"] is None else m["power_saving"] * 100, "{:.0f}%", na),
        ]
        out.append("| " + " | ".join(cells) + " |")
    if levels:
        out += [
            "",
            "Concurrency sweep (aggregate tok/s"
            + (", min–max of the runs" if result["repetitions"] > 1 else "")
            + "; per-stream decode tok/s in square brackets):",
            "",
        ]
        out.append("| model | precision | " + " | ".join(f"{c} at once" for c in levels) + " |")
        out.append("|" + "---|" * (2 + len(levels)))
        for m in models:
            by = {c["concurrency"]: c for c in m["concurrency"]}
            cells = [
                f"{cell(by[c].get('aggregate_tok_s_stats'))} [{_f(by[c]['per_stream_tok_s'])}]"
                if c in by
                else "—"
                for c in levels
            ]
            out.append(f"| {m['model']} | {m['precision']} | " + " | ".join(cells) + " |")
    if result.get("warnings"):
        out += ["", "Warnings:"]
        out += [f"- ⚠ {w}" for w in result["warnings"]]
    out.append("")
    for m in models:
        out.append(f"- {m['model']}: prompt lengths {m['token_counting']}.")
        for n in m["notes"]:
            out.append(f"- {m['model']}: {n}")
    out.append("- " + result["method"] + ".")
    if not power:
        out.append(
            "- Power: n/a (bench through a phasewatch proxy that samples GPU power to get it)."
        )
    else:
        out.append(
            "- decode W: GPU power over each decode run's decode window; idle W: over a pause "
            "with nothing sent (--idle-seconds); J/tok = decode W / decode tok/s."
        )
    secs: dict[str, float] = {}
    for m in models:
        for k, v in (m.get("seconds") or {}).items():
            if k != "tokenizer_calls":
                secs[k] = secs.get(k, 0.0) + v
    if secs:
        parts = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(secs.items(), key=lambda kv: -kv[1]))
        out.append(f"- Time: {result['seconds']:.0f} s in all: {parts}.")
    return "\n".join(out) + "\n"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from exc
    if any(v < 1 for v in values):
        raise ValueError(f"values must be at least 1, got {text!r}")
    return values


def add_arguments(parser) -> None:
    import argparse

    def ints(text):
        try:
            return _ints(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8090",
        help="OpenAI-compatible base URL, usually phasewatch's [default http://127.0.0.1:8090].",
    )
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help="Model to benchmark (repeatable; default: every model the endpoint lists).",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="Repetitions per scenario; the median is reported [default 3].",
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="Warm-up requests per model [default 1]."
    )
    parser.add_argument(
        "--decode-tokens",
        type=int,
        default=256,
        help="Output tokens of the decode scenario [default 256].",
    )
    parser.add_argument(
        "--decode-prompt",
        type=int,
        default=128,
        help="Prompt tokens of the decode scenario [default 128].",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=ints,
        default=[4096, 8192, 16384],
        help="Prompt sizes of the prefill/TTFT scenario [default 4096,8192,16384].",
    )
    parser.add_argument(
        "--concurrency",
        type=ints,
        default=[1, 2, 4, 8],
        help="Concurrency levels of the sweep [default 1,2,4,8]; '' skips it.",
    )
    parser.add_argument(
        "--sweep-tokens",
        type=int,
        default=128,
        help="Output tokens per request in the sweep [default 128].",
    )
    parser.add_argument(
        "--sweep-prompt",
        type=int,
        default=128,
        help="Prompt tokens per request in the sweep [default 128].",
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="Do not send ignore_eos (for servers that reject unknown fields).",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="Bearer token [env OPENAI_API_KEY].",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="Per-request timeout, seconds."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompt words.")
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=1.0,
        help="Pause before each model's runs, sending nothing, to measure idle GPU power "
        "through phasewatch [default 1]; 0 skips it.",
    )
    parser.add_argument(
        "--max-spread",
        type=float,
        default=0.10,
        help="Warn when a figure's runs spread more than this share of their median "
        "((max - min) / median) [default 0.10].",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        default=None,
        help="Compare two results written by --output (nothing is benchmarked): per model, "
        "precision and figure both values, the change and whether it is beyond the runs' "
        "spread.",
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="Also draw the result as PNG and SVG charts in DIR (needs matplotlib: "
        "pip install 'phasewatch[plot]').",
    )
    parser.add_argument("--json", action="store_true", help="Print JSON instead of the table.")
    parser.add_argument("--output", default=None, help="Also write the JSON result to this file.")
    parser.add_argument("--quiet", action="store_true", help="No progress output.")


def run(args) -> int:
    if args.compare:
        from .bench_compare import load, render

        try:
            a, b = load(args.compare[0]), load(args.compare[1])
        except (OSError, ValueError) as exc:
            print(f"phasewatch bench: --compare: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(render(a, b, args.compare[0], args.compare[1]))
        return 0
    if args.plot:
        from .plots import PlotError, require

        try:
            require()
        except PlotError as exc:
            print(f"phasewatch bench: {exc}", file=sys.stderr)
            return 2
    if args.idle_seconds < 0 or args.max_spread < 0:
        print(
            "phasewatch bench: --idle-seconds and --max-spread must not be negative",
            file=sys.stderr,
        )
        return 2
    for name in ("repeat", "decode_tokens", "decode_prompt", "sweep_tokens", "sweep_prompt"):
        if getattr(args, name) < 1:
            print(
                f"phasewatch bench: --{name.replace('_', '-')} must be at least 1", file=sys.stderr
            )
            return 2
    try:
        result = asyncio.run(run_bench(args))
    except (BenchError, httpx.HTTPError) as exc:
        print(f"\nphasewatch bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    sys.stdout.write(json.dumps(result, indent=2) + "\n" if args.json else table(result))
    for w in result["warnings"] if args.json or args.quiet else ():
        print(f"phasewatch bench: warning: {w}", file=sys.stderr)
    if args.plot:
        from .plots import bench_charts

        for path in bench_charts(result, args.plot):
            print(f"phasewatch bench: wrote {path}", file=sys.stderr)
    return 0
