"""What the simulated vLLM serves beside generation: its own request histograms,
preemption and prefix-cache counters and ``cache_config_info`` on ``/metrics`` (names,
buckets and label layout of vLLM 0.32, fixtures/vllm-real ``metrics_after``), and
``/v1/embeddings``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import uuid
from bisect import bisect_left

from .engine import SimEngine, Truth, tokenize
from .physics import BLOCK_SIZE, GPU_MEMORY_UTILIZATION, kv_cache_blocks

#: vLLM 0.32's buckets (its metrics page).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip

_TTFT_HELP = "Histogram of time to first token in seconds."
_E2E_HELP = "Histogram of e2e request latency in seconds."
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", _TTFT_HELP, TTFT_BUCKETS),
    ("vllm:e2e_request_latency_seconds", _E2E_HELP, E2E_BUCKETS),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        TPOT_BUCKETS,
    ),
    (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        E2E_BUCKETS,
    ),
)  # fmt: skip


class _Hist:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, c in zip((*self.bounds, math.inf), self.counts):
            total += c
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(total)}')
        out.append(f"{name}_count{{{labels}}} {float(total)}")
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        return out


class VLLMStats:
    """Per model: vLLM's own request histograms and counters, fed from the truth of each
    finished request."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.hists = {
            mid: {name: _Hist(bounds) for name, _, bounds in _HISTOGRAMS} for mid in engine.models
        }
        self.preemptions = dict.fromkeys(engine.models, 0)
        self.prefix_queries = dict.fromkeys(engine.models, 0)
        self.prefix_hits = dict.fromkeys(engine.models, 0)

    def observe(self, truth: Truth) -> None:
        """A finished request, as vLLM's engine records it (aborted ones are not)."""
        hists = self.hists.get(truth.model)
        if hists is None or truth.aborted:
            return
        self.prefix_queries[truth.model] += truth.prompt_tokens
        self.prefix_hits[truth.model] += truth.cached_tokens
        if truth.t_first is not None:
            hists["vllm:time_to_first_token_seconds"].observe(truth.t_first - truth.t_recv)
        if truth.t_admit is not None:
            hists["vllm:request_queue_time_seconds"].observe(truth.t_admit - truth.t_recv)
        if truth.t_end is not None:
            hists["vllm:e2e_request_latency_seconds"].observe(truth.t_end - truth.t_recv)
        if truth.t_first is not None and truth.t_last is not None and truth.completion_tokens > 1:
            hists["vllm:request_time_per_output_token_seconds"].observe(
                (truth.t_last - truth.t_first) / (truth.completion_tokens - 1)
            )

    def metrics_lines(self) -> list[str]:
        out = []
        for name, help_text, counts in (
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                self.preemptions,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.prefix_hits,
            ),
        ):
            out += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter"]
            out += [
                f'{name}_total{{engine="0",model_name="{mid}"}} {float(v)}'
                for mid, v in counts.items()
            ]
        for name, help_text, _ in _HISTOGRAMS:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            for mid, hists in self.hists.items():
                out += hists[name].lines(name, f'engine="0",model_name="{mid}"')
        out += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
        ]
        for mid, me in self.engine.models.items():
            spec = me.spec
            blocks = kv_cache_blocks(spec, spec_memory(me))
            # one engine per model in real vLLM (no model_name label there): the simulator
            # serves several, so it names the model
            out.append(
                "vllm:cache_config_info{"
                f'block_size="{BLOCK_SIZE}",cache_dtype="{spec.kv_cache_dtype}",'
                f'enable_prefix_caching="True",engine="0",'
                f'gpu_memory_utilization="{GPU_MEMORY_UTILIZATION}",'
                f'kv_cache_memory_bytes="{int(blocks * BLOCK_SIZE * spec.kv_bytes_per_token)}",'
                f'kv_cache_size_tokens="{blocks * BLOCK_SIZE}",model_name="{mid}",'
                f'num_gpu_blocks="{blocks}",sliding_window="None"}} 1.0'
            )
        return out


def spec_memory(me) -> float:
    return me.gpu.memory_gb * 1e9


def embedding_vector(token: int, dims: int = 8) -> list[float]:
    """A deterministic unit-length vector for a token (the sim has no real model)."""
    digest = hashlib.sha256(str(token).encode()).digest()
    raw = [b / 255.0 - 0.5 for b in digest[:dims]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def embed(texts: list[str]) -> tuple[list[list[float]], int]:
    """(one mean-pooled vector per text, input tokens in all)."""
    vectors, n = [], 0
    for text in texts:
        tokens = tokenize(text) or [0]
        n += len(tokens)
        per = [embedding_vector(t) for t in tokens]
        vectors.append([round(sum(col) / len(per), 6) for col in zip(*per)])
    return vectors, n


def inputs(value: object) -> list[str] | None:
    """The texts of an embeddings request's ``input`` (a string or a list of them)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def vllm_embeddings_body(model: str, texts: list[str], deterministic: bool) -> bytes:
    """vLLM 0.32's /v1/embeddings answer (EmbeddingResponse, compact JSON)."""
    vectors, n = embed(texts)
    if deterministic:
        ident = hashlib.sha256(f"{model}|{texts}".encode()).hexdigest()[:32]
        created = 1796012797
    else:
        ident, created = uuid.uuid4().hex, int(time.time())
    body = {
        "id": f"embd-{ident}",
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }  # fmt: skip
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
