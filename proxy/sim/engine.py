"""The simulator's engine: a scheduler per model (one GPU each), token generation, and
a ground-truth log of the timings it produced, so tests compare the proxy with truth.

Each model runs on its own simulated GPU with a real concurrency limit (max_num_seqs)
and a FIFO waiting queue. A running request sleeps its prefill time, then one decode step
per token; a step's length depends on the batch at that moment (continuous batching,
simplified). Deadlines are absolute, so sleeps do not drift.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field

from .physics import (
    DEFAULT_MODELS,
    GPU,
    RTX_4090,
    ModelSpec,
    decode_step_seconds,
    power_watts,
    prefill_seconds,
)
from .sensors import PROFILES, DcgmExporter, PowerTrace, Sensor

_WORDS = (
    "the",
    "model",
    "decode",
    "prefill",
    "token",
    "phase",
    "cache",
    "memory",
    "bandwidth",
    "weights",
    "latency",
    "quiet",
    "answer",
    "request",
    "batch",
    "GPU",
    "watts",
    "fast",
    "slow",
    "context",
    "prompt",
    "engine",
    "stream",
    "queue",
    "precision",
    "int4",
    "bf16",
    "energy",
    "time",
    "first",
    "last",
    "per",
    "second",
    "and",
    "of",
    "to",
    "a",
    "is",
    "on",
    "with",
    "café",
    "naïve",
    "☕",
    "<tag>",
    '"quoted"',
    "back\\slash",
    "tab\there",
    "über",
    "数据",
    "ok.",
)

_PIECE = re.compile(r"\S+")


def count_tokens(text: str) -> int:
    """The simulator's tokenizer: one token per whitespace-separated piece."""
    return len(_PIECE.findall(text))


def tokenize(text: str) -> list[int]:
    return [
        int.from_bytes(hashlib.blake2s(p.encode(), digest_size=3).digest(), "big")
        for p in _PIECE.findall(text)
    ]


@dataclass
class Plan:
    """What one request will produce."""

    pieces: list[str]
    finish_reason: str  # "stop" or "length"


def plan_output(seed_text: str, max_tokens: int | None, ignore_eos: bool, seed: int | None) -> Plan:
    """Deterministic output for a prompt: same prompt, same answer (temperature ignored)."""
    rng = random.Random(hashlib.sha256(f"{seed}|{seed_text}".encode()).digest())
    natural = rng.randint(12, 160)
    if max_tokens is not None and (ignore_eos or max_tokens <= natural):
        n, reason = max_tokens, "length"
    else:
        n, reason = natural, "stop"
    pieces = [(" " if i else "") + rng.choice(_WORDS) for i in range(n)]
    if reason == "stop" and pieces:
        pieces[-1] = ""  # the EOS token produces no text but is counted
    return Plan(pieces, reason)


@dataclass
class Truth:
    """Ground truth of one simulated request (sim process's monotonic clock)."""

    request_id: str
    model: str
    precision: str
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    t_recv: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    prefill_seconds: float = 0.0
    aborted: bool = False
    gpu: int | None = None
    #: The request's share of its GPU's energy: each moment's draw split evenly among the
    #: requests running then (idle draw belongs to no request).
    energy_joules: float | None = None
    step_seconds: list[float] = field(default_factory=list, repr=False)

    def as_json(self) -> str:
        d = {k: v for k, v in self.__dict__.items() if k != "step_seconds"}
        if self.t_first is not None and self.t_last is not None and self.completion_tokens >= 2:
            d["decode_seconds"] = self.t_last - self.t_first
            d["decode_tokens_per_second"] = (self.completion_tokens - 1) / (
                self.t_last - self.t_first
            )
        if self.t_admit is not None:
            d["queue_seconds"] = self.t_admit - self.t_recv
        if self.t_first is not None:
            d["ttft_seconds"] = self.t_first - self.t_recv
        return json.dumps(d)


class ModelEngine:
    """One model on one simulated GPU."""

    def __init__(
        self,
        spec: ModelSpec,
        gpu: GPU,
        gpu_index: int,
        max_num_seqs: int,
        speed: float,
        jitter: float,
        rng: random.Random,
        sensor: str = "ideal",
    ) -> None:
        self.spec = spec
        self.gpu = gpu
        self.gpu_index = gpu_index
        self.max_num_seqs = max_num_seqs
        self.speed = speed
        self.jitter = jitter
        self.rng = rng
        self.running: dict[int, int] = {}  # request key -> current context length
        self.prefilling = 0
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self.aborted_total = 0
        self.finished_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.energy_joules = 0.0
        self.request_energy: dict[int, float] = {}  # running request key -> joules so far
        self._power_t = time.monotonic()
        self._power_lock = threading.Lock()
        #: the true power, step by step, and what the GPU's sensor makes of it
        self.trace = PowerTrace(self._power_t, self.power())
        self.sensor = Sensor(PROFILES[sensor], self.trace, self.power, gpu_index)

    # --- power (integrated on every state change and on read) -------------------------

    def state(self) -> str:
        if self.prefilling:
            return "prefill"
        return "decode" if self.running else "idle"

    def power(self) -> float:
        return power_watts(self.spec, self.gpu, self.state(), max(1, len(self.running)))

    def _integrate(self) -> None:
        with self._power_lock:
            now = time.monotonic()
            joules = self.trace.segment(now, self.power()) if now > self._power_t else 0.0
            self.energy_joules += joules
            self._power_t = now
            if self.running:
                share = joules / len(self.running)
                for key in self.running:
                    self.request_energy[key] = self.request_energy.get(key, 0.0) + share

    def read_energy(self) -> float:
        self._integrate()
        return self.energy_joules

    # --- scheduling -------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def admit(self, key: int, context: int) -> None:
        if len(self.running) >= self.max_num_seqs or self._waiting:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_next()  # woken, then cancelled: the turn passes on
                elif fut in self._waiting:  # a release may already have dropped it
                    self._waiting.remove(fut)
                raise
        self._integrate()
        self.running[key] = context

    def release(self, key: int) -> float:
        """Free the request's slot; returns its share of the GPU's energy (J)."""
        self._integrate()
        self.running.pop(key, None)
        self._wake_next()
        with self._power_lock:
            return self.request_energy.pop(key, 0.0)

    def _wake_next(self) -> None:
        while self._waiting and len(self.running) < self.max_num_seqs:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def _jittered(self, seconds: float) -> float:
        if self.jitter:
            seconds *= max(0.5, self.rng.gauss(1.0, self.jitter))
        return seconds / self.speed

    def prefill_time(self, new_tokens: int, cached: int) -> float:
        return self._jittered(prefill_seconds(self.spec, self.gpu, new_tokens, cached))

    def step_time(self) -> float:
        return self._jittered(
            decode_step_seconds(self.spec, self.gpu, len(self.running), sum(self.running.values()))
        )

    async def prefill(self, start: float, new_tokens: int, cached: int) -> None:
        """Run a prompt's prefill from `start` (power state prefill meanwhile)."""
        seconds = self.prefill_time(new_tokens, cached)
        self._integrate()
        self.prefilling += 1
        try:
            await sleep_until(start + seconds)
        finally:
            self._integrate()
            self.prefilling -= 1

    async def steps(self, key: int, context: int, n: int):
        """Yield 0 .. n-1, one per decode step, each when the physics says it is done;
        the request's context grows by one token a step."""
        deadline = time.monotonic()
        for i in range(n):
            if i:
                deadline += self.step_time()
                await sleep_until(deadline)
            self.running[key] = context + i + 1
            self.generation_tokens_total += 1
            yield i


class SimEngine:
    """All simulated models, the truth log and the abort counter."""

    def __init__(
        self,
        models: tuple[ModelSpec, ...] = DEFAULT_MODELS,
        gpu: GPU = RTX_4090,
        max_num_seqs: int = 16,
        speed: float = 1.0,
        jitter: float = 0.02,
        truth_path: str | None = None,
        seed: int = 0,
        deterministic: bool = False,
        sensor: str = "ideal",
        dcgm_interval: float = 0.0,
        dcgm_instant: bool = True,
    ) -> None:
        rng = random.Random(seed)
        self.models = {
            m.id: ModelEngine(m, gpu, i, max_num_seqs, speed, jitter, rng, sensor)
            for i, m in enumerate(models)
        }
        #: the dcgm-exporter beside the simulated GPUs (its collection interval, whether
        #: its counters file has the instant field)
        self.exporter = DcgmExporter(dcgm_interval, dcgm_instant)
        self.gpu = gpu
        self.deterministic = deterministic
        self.started = int(time.time())
        # open for the engine's life (one line per request), closed by close()
        self._truth = (
            open(truth_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            if truth_path
            else None
        )
        self._key = 0

    def next_key(self) -> int:
        self._key += 1
        return self._key

    def write_truth(self, truth: Truth) -> None:
        if self._truth is not None and not self._truth.closed:  # closed: shutting down
            line = truth.as_json()
            me = next((m for m in self.models.values() if m.gpu_index == truth.gpu), None)
            if me is not None and truth.t_end is not None:
                # the GPU's true power over the request's life (each step), so a test can
                # take the true mean over any window the proxy measured
                me._integrate()
                trace = me.trace.steps(truth.t_recv, truth.t_end, me.power())
                line = line[:-1] + ', "power_trace": ' + json.dumps(trace) + "}"
            self._truth.write(line + "\n")

    def close(self) -> None:
        if self._truth is not None:
            self._truth.close()


async def sleep_until(deadline: float) -> None:
    """Sleep to an absolute monotonic deadline (no drift across many tokens)."""
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
