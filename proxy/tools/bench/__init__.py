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

The modules, one concern each: :mod:`.client` (one timed request), :mod:`.prompts`
(prompts of exact length, through the engine registry's tokenizers), :mod:`.scenarios`
(one model's runs), :mod:`.power` (watts from phasewatch's page), :mod:`.traffic` (other
traffic on the engine), :mod:`.session` (a whole bench), :mod:`.stats` and
:mod:`.render` (figures and the table), :mod:`.compare` (``--compare``) and
:mod:`.command` (the arguments).
"""

from __future__ import annotations

from .client import BenchError, Client, Shot
from .command import _ints, add_arguments, run
from .prompts import Prompts
from .render import runs_phrase, table, warnings
from .session import run_bench
from .stats import spread, stats

__all__ = [
    "BenchError",
    "Client",
    "Prompts",
    "Shot",
    "_ints",
    "add_arguments",
    "run",
    "run_bench",
    "runs_phrase",
    "spread",
    "stats",
    "table",
    "warnings",
]
