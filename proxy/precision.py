"""Model precision: a small normalised vocabulary plus the raw scheme (SPEC §2).

`precision` is a bounded label (bf16, fp16, fp32, fp8, int8, int4, fp4, ... unknown);
`quant` keeps the raw scheme (Q4_K_M, AWQ, GPTQ, NVFP4, W8A8 ...). Sources in order:
operator override, what the engine says (engine dialects feed :func:`from_gguf_type`
and friends), model-name patterns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8", "fp6", "int6", "int5", "fp4", "int4",
              "int3", "int2", "int1", "unknown")


@dataclass(frozen=True)
class Precision:
    precision: str  # one of PRECISIONS
    quant: str = ""  # raw scheme as the engine or name says it
    source: str = "none"  # config | engine | name | none

    @staticmethod
    def unknown() -> "Precision":
        return Precision("unknown", "", "none")


# GGUF / llama.cpp type names -> normalised precision. Also used for Ollama's
# quantization_level ("Q4_K_M", "F16", ...) and llama-server ftype strings.
_GGUF = {
    "F32": "fp32", "F16": "fp16", "BF16": "bf16",
    "Q8_0": "int8", "Q8_1": "int8", "Q8_K": "int8",
    "Q6_K": "int6", "Q5_0": "int5", "Q5_1": "int5", "Q5_K": "int5", "Q5_K_S": "int5",
    "Q5_K_M": "int5", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q4_K_S": "int4",
    "Q4_K_M": "int4", "Q4_0_4_4": "int4", "Q4_0_4_8": "int4", "Q4_0_8_8": "int4",
    "IQ4_NL": "int4", "IQ4_XS": "int4", "MXFP4": "fp4", "Q3_K": "int3", "Q3_K_S": "int3",
    "Q3_K_M": "int3", "Q3_K_L": "int3", "IQ3_XXS": "int3", "IQ3_XS": "int3", "IQ3_S": "int3",
    "IQ3_M": "int3", "Q2_K": "int2", "Q2_K_S": "int2", "IQ2_XXS": "int2", "IQ2_XS": "int2",
    "IQ2_S": "int2", "IQ2_M": "int2", "IQ1_S": "int1", "IQ1_M": "int1", "TQ1_0": "int1",
    "TQ2_0": "int2",
}

_GGUF_RE = re.compile(
    r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[0-9])?(?:_K)?(?:_[SMLX]{1,3}|_NL|_XXS|_XS)?|TQ[12]_0|MXFP4|BF16|F16|F32)(?![A-Za-z0-9])",
    re.IGNORECASE)


def from_gguf_type(text: str) -> Precision | None:
    """Precision from a GGUF type name anywhere in `text` (a file name, an Ollama
    quantization_level, a model id like ``qwen2.5:7b-instruct-q4_K_M``)."""
    for m in _GGUF_RE.finditer(text):
        raw = m.group(1).upper()
        if raw in _GGUF:
            return Precision(_GGUF[raw], raw, "engine")
    return None


# Ordered: the first matching rule wins, so specific schemes come before generic bits.
_NAME_RULES: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), prec, quant) for p, prec, quant in (
        (r"nvfp4", "fp4", "NVFP4"),
        (r"mxfp4", "fp4", "MXFP4"),
        (r"(?<![a-z0-9])fp4(?![0-9])", "fp4", "FP4"),
        (r"w4a16", "int4", "W4A16"),
        (r"w4a4", "int4", "W4A4"),
        (r"w8a8[-_]?fp8|fp8[-_]?dynamic|fp8", "fp8", "FP8"),
        (r"w8a8", "int8", "W8A8"),
        (r"w8a16", "int8", "W8A16"),
        (r"awq", "int4", "AWQ"),
        (r"gptq[-_]?int8|gptq[-_]?8bit", "int8", "GPTQ"),
        (r"gptq", "int4", "GPTQ"),
        (r"exl2", "int4", "EXL2"),
        (r"bnb[-_]?4bit|4bit|4[-_]bit|nf4", "int4", "BNB-4bit"),
        (r"bnb[-_]?8bit|8bit|8[-_]bit", "int8", "BNB-8bit"),
        (r"(?<![a-z0-9])int4(?![0-9])", "int4", "INT4"),
        (r"(?<![a-z0-9])int8(?![0-9])", "int8", "INT8"),
        (r"(?<![a-z0-9])bf16(?![0-9])", "bf16", "BF16"),
        (r"(?<![a-z0-9])(fp16|f16|half)(?![0-9])", "fp16", "FP16"),
        (r"(?<![a-z0-9])(fp32|f32)(?![0-9])", "fp32", "FP32"),
    ))


def from_name(model: str) -> Precision | None:
    """Best guess from a model id or path (vLLM ids, HF repo names, GGUF file names)."""
    g = from_gguf_type(model)
    if g is not None:
        return Precision(g.precision, g.quant, "name")
    for pattern, prec, quant in _NAME_RULES:
        if pattern.search(model):
            return Precision(prec, quant, "name")
    return None


def normalise(value: str) -> Precision:
    """An operator's override (``bf16``, ``int4``, ``Q4_K_M``, ``AWQ`` ...)."""
    v = value.strip()
    if v.lower() in PRECISIONS:
        return Precision(v.lower(), "", "config")
    guessed = from_name(v)
    if guessed is not None:
        return Precision(guessed.precision, guessed.quant, "config")
    return Precision("unknown", v, "config")


class PrecisionTable:
    """Per-model precision with operator overrides first; cached per model name."""

    def __init__(self, overrides: dict[str, str] | None = None) -> None:
        self._overrides = {k: normalise(v) for k, v in (overrides or {}).items()}
        self._cache: dict[str, Precision] = {}

    def set_engine(self, model: str, p: Precision | None) -> None:
        """Record what the engine says about a model (used unless overridden)."""
        if p is not None:
            self._cache[model] = p

    def set_name_hint(self, model: str, other_name: str) -> None:
        """Another name for the model (vLLM's `root` path) to read a precision from when
        the model's own name says nothing."""
        if model not in self._cache and from_name(model) is None:
            p = from_name(other_name)
            if p is not None:
                self._cache[model] = p

    def get(self, model: str) -> Precision:
        if model in self._overrides:
            return self._overrides[model]
        p = self._cache.get(model)
        if p is None:
            p = from_name(model) or Precision.unknown()
            self._cache[model] = p
        return p
