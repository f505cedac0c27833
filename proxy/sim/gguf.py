"""What the simulated GGUF engines (Ollama, llama-server) share: their model catalogue at
GGUF precisions and a one-slot prefix cache.

GGUF formats on the physics of :mod:`proxy.sim.physics`: F16 reads 2 bytes per weight,
Q8_0 ~1.06, Q4_K_M ~0.60 (4.85 bits with its scales and the higher-precision layers it
keeps), so decode speeds up ~3x from F16 to Q4_K_M while prefill gains far less.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import Truth
from .physics import ModelSpec, PrecisionProfile

GGUF_PROFILES = {
    "F16": PrecisionProfile("fp16", "F16", 2.0, 0.80, 1.00, 430.0, 360.0),
    "Q8_0": PrecisionProfile("int8", "Q8_0", 1.0625, 0.75, 1.10, 410.0, 300.0),
    "Q4_K_M": PrecisionProfile("int4", "Q4_K_M", 0.606, 0.70, 1.15, 395.0, 245.0),
}

#: llama.cpp's ftype names (``/props`` model_ftype) and GGUF file_type numbers.
FTYPE_NAMES = {"F16": "F16", "Q8_0": "Q8_0", "Q4_K_M": "Q4_K - Medium"}
FILE_TYPES = {"F16": 1, "Q8_0": 7, "Q4_K_M": 15}


def llama31_8b(model_id: str, quant: str) -> ModelSpec:
    return ModelSpec(model_id, 8.03, 32, 8, 128, 4096, GGUF_PROFILES[quant], 131072)


def qwen25_7b(model_id: str, quant: str) -> ModelSpec:
    return ModelSpec(model_id, 7.62, 28, 4, 128, 3584, GGUF_PROFILES[quant], 32768)


#: Ollama: one 8B model pulled at three quantisations (the tag names the format).
OLLAMA_MODELS = (
    llama31_8b("llama3.1:8b-instruct-fp16", "F16"),
    llama31_8b("llama3.1:8b-instruct-q8_0", "Q8_0"),
    llama31_8b("llama3.1:8b-instruct-q4_K_M", "Q4_K_M"),
)

#: llama-server serves one model (its alias); the GGUF file name says Q4_K_M.
LLAMACPP_MODELS = (qwen25_7b("qwen2.5-7b-instruct", "Q4_K_M"),)
LLAMACPP_PATH = "/models/qwen2.5-7b-instruct-q4_k_m.gguf"


@dataclass
class EngineTruth(Truth):
    """Ground truth plus what a GGUF engine reports about itself."""

    load_seconds: float = 0.0
    engine_wait_seconds: float = 0.0  # semaphore / slot wait inside the engine
    reported: dict | None = None  # the timing fields the response carried


class PrefixCache:
    """llama.cpp keeps a slot's last prompt in its KV cache: a new prompt sharing a
    prefix with it re-uses those tokens (at least the last one is evaluated again)."""

    def __init__(self) -> None:
        self._last: dict[str, list[int]] = {}

    def hit(self, model: str, tokens: list[int]) -> int:
        prev = self._last.get(model, [])
        n = 0
        for a, b in zip(prev, tokens):
            if a != b:
                break
            n += 1
        self._last[model] = tokens
        return min(n, max(0, len(tokens) - 1))


def chat_text(messages) -> str:
    parts = []
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict):
            content = m.get("content")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<|{m.get('role', 'user')}|> {content or ''}")
    return " ".join(parts) + " <|assistant|>"
