"""Model precision: a small normalised vocabulary plus the raw scheme.

`precision` is a bounded label (bf16, fp16, fp32, fp8, int8, int4, fp4, ... unknown);
`quant` keeps the raw scheme (Q4_K_M, AWQ, GPTQ, NVFP4, W8A8 ...). Sources in order:
operator override, what the engine says (the engine modules feed :func:`from_gguf_type`
and friends), model-name patterns. Detected once per model and cached.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = (
    "fp32",
    "bf16",
    "fp16",
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


@dataclass(frozen=True)
class Precision:
    precision: str  # one of PRECISIONS
    quant: str = ""  # raw scheme as the engine or name says it
    source: str = "none"  # config | engine | name | none

    @staticmethod
    def unknown() -> Precision:
        return Precision("unknown", "", "none")


# GGUF / llama.cpp type names -> normalised precision. Also used for Ollama's
# quantization_level ("Q4_K_M", "F16", ...) and llama-server ftype strings.
_GGUF = {
    "F32": "fp32",
    "F16": "fp16",
    "BF16": "bf16",
    "Q8_0": "int8",
    "Q8_1": "int8",
    "Q8_K": "int8",
    "Q6_K": "int6",
    "Q5_0": "int5",
    "Q5_1": "int5",
    "Q5_K": "int5",
    "Q5_K_S": "int5",
    "Q5_K_M": "int5",
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q4_K_S": "int4",
    "Q4_K_M": "int4",
    "Q4_0_4_4": "int4",
    "Q4_0_4_8": "int4",
    "Q4_0_8_8": "int4",
    "IQ4_NL": "int4",
    "IQ4_XS": "int4",
    "MXFP4": "fp4",
    "Q3_K": "int3",
    "Q3_K_S": "int3",
    "Q3_K_M": "int3",
    "Q3_K_L": "int3",
    "IQ3_XXS": "int3",
    "IQ3_XS": "int3",
    "IQ3_S": "int3",
    "IQ3_M": "int3",
    "Q2_K": "int2",
    "Q2_K_S": "int2",
    "IQ2_XXS": "int2",
    "IQ2_XS": "int2",
    "IQ2_S": "int2",
    "IQ2_M": "int2",
    "IQ1_S": "int1",
    "IQ1_M": "int1",
    "TQ1_0": "int1",
    "TQ2_0": "int2",
    "MXFP4_MOE": "fp4",
    "NVFP4": "fp4",
    "Q1_0": "int1",
}

GGUF_TYPE_RE = re.compile(
    r"(?<![A-Za-z0-9])(I?Q[1-8](?:_[0-9])?(?:_K)?(?:_[SMLX]{1,3}|_NL|_XXS|_XS)?|TQ[12]_0|MXFP4(?:_MOE)?|NVFP4|BF16|F16|F32)(?![A-Za-z0-9])",
    re.IGNORECASE,
)


def from_gguf_type(text: str) -> Precision | None:
    """Precision from a GGUF type name anywhere in `text` (a file name, an Ollama
    quantization_level, a model id like ``qwen2.5:7b-instruct-q4_K_M``)."""
    for m in GGUF_TYPE_RE.finditer(text):
        raw = m.group(1).upper()
        if raw in _GGUF:
            return Precision(_GGUF[raw], raw, "engine")
    return None


# Ordered: the first matching rule wins, so specific schemes come before generic bits.
_NAME_RULES: tuple[tuple[re.Pattern[str], str, str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), prec, quant)
    for p, prec, quant in (
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
    )
)


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


# --- what the engines say (each engine module reads them) ---------------------------------

#: llama.cpp's `general.file_type` (llama_ftype) numbers, as Ollama's /api/show
#: model_info and GGUF metadata carry them.
GGUF_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}

_FTYPE_NAME_RE = re.compile(
    r"^\s*(?:all\s+)?([A-Za-z0-9_]+)(?:\s+-\s+(Small|Medium|Large))?"
    r"(?:\s+MoE)?",
    re.IGNORECASE,
)


def from_gguf_file_type(value) -> Precision | None:
    """Precision from a GGUF `general.file_type` number."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    name = GGUF_FILE_TYPES.get(value)
    return Precision(_GGUF[name], name, "engine") if name in _GGUF else None


def from_llama_ftype(text: str) -> Precision | None:
    """Precision from llama-server's ftype string (``/props`` model_ftype, ``/v1/models``
    meta.ftype): ``"Q4_K - Medium"``, ``"all F32"``, ``"IQ4_XS - 4.25 bpw"``, ``"MXFP4 MoE"``."""
    if not isinstance(text, str) or not text.strip():
        return None
    m = _FTYPE_NAME_RE.match(text)
    if m is None:
        return None
    name = m.group(1).upper()
    if m.group(2):
        name += "_" + m.group(2)[0].upper()
    if "MOE" in text.upper() and name == "MXFP4":
        name = "MXFP4_MOE"
    if name in _GGUF:
        return Precision(_GGUF[name], name, "engine")
    return from_gguf_type(text)


def from_bits_per_weight(size_bytes, n_params) -> Precision | None:
    """A last resort for GGUF servers: 8 * file size / parameters. Mixed files (big
    embeddings kept at higher precision) read high on small models."""
    if not isinstance(size_bytes, (int, float)) or not isinstance(n_params, (int, float)):
        return None
    if size_bytes <= 0 or n_params <= 0:
        return None
    try:
        bpw = 8.0 * size_bytes / n_params
    except OverflowError:  # an engine's size too large for a float: no precision from it
        return None
    if not bpw <= 64.0:  # no weight has more bits; NaN and inf fail too
        return None
    for bound, prec in (
        (24.0, "fp32"),
        (12.0, "fp16"),
        (7.0, "int8"),
        (5.5, "int6"),
        (5.0, "int5"),
        (3.5, "int4"),
        (2.5, "int3"),
        (1.8, "int2"),
    ):
        if bpw >= bound:
            return Precision(prec, f"{bpw:.2f}bpw", "engine")
    return Precision("int1", f"{bpw:.2f}bpw", "engine")


_DTYPES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "fp32": "fp32",
    "float": "fp32",
}


def from_hf_config(config: dict) -> Precision | None:
    """Precision from a Hugging Face ``config.json`` (what vLLM loads): its
    ``quantization_config`` when there is one, else ``torch_dtype`` / ``dtype``."""
    if not isinstance(config, dict):
        return None
    q = config.get("quantization_config")
    if isinstance(q, dict):
        p = _from_quant_config(q)
        if p is not None:
            return p
    for key in ("torch_dtype", "dtype"):
        dtype = config.get(key)
        if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
            return Precision(
                _DTYPES[dtype.lower().removeprefix("torch.")],
                dtype.upper().removeprefix("TORCH."),
                "engine",
            )
    text = config.get("text_config")
    return from_hf_config(text) if isinstance(text, dict) else None


def _int_bits(bits, default: int = 4) -> str:
    return {8: "int8", 4: "int4", 3: "int3", 2: "int2"}.get(
        bits if isinstance(bits, int) else default, "int4"
    )


def _from_quant_config(q: dict) -> Precision | None:
    method = str(q.get("quant_method") or q.get("quant_algo") or "").lower()
    bits = q.get("bits", q.get("w_bit"))
    if method in ("awq", "awq_marlin"):
        return Precision(_int_bits(bits), "AWQ", "engine")
    if method in ("gptq", "gptq_marlin", "gptq_bitblas"):
        return Precision(_int_bits(bits), "GPTQ", "engine")
    if method in ("fp8", "fbgemm_fp8", "ptpc_fp8"):
        return Precision("fp8", "FP8", "engine")
    if method == "mxfp4":
        return Precision("fp4", "MXFP4", "engine")
    if method == "bitsandbytes":
        four = q.get("load_in_4bit") or q.get("bnb_4bit_quant_type")
        return (
            Precision("int4", "BNB-4bit", "engine")
            if four
            else Precision("int8", "BNB-8bit", "engine")
        )
    if method in ("modelopt", "modelopt_fp4", "nvfp4"):
        algo = str(
            q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo") or method
        ).upper()
        if "FP4" in algo:
            return Precision("fp4", "NVFP4", "engine")
        return Precision("fp8", "FP8", "engine")
    if method == "experts_int8":
        return Precision("int8", "INT8", "engine")
    if method == "compressed-tensors":
        fmt = str(q.get("format") or "").lower()
        if "nvfp4" in fmt:
            return Precision("fp4", "NVFP4", "engine")
        for group in (q.get("config_groups") or {}).values():
            if not isinstance(group, dict):
                continue
            w = group.get("weights") or {}
            a = group.get("input_activations") or {}
            nb, kind = w.get("num_bits"), str(w.get("type") or "int").lower()
            if kind == "float" and nb == 8:
                return Precision("fp8", "FP8", "engine")
            if kind == "float" and nb == 4:
                return Precision(
                    "fp4",
                    "NVFP4" if "nvfp4" in fmt or w.get("group_size") == 16 else "FP4",
                    "engine",
                )
            if type(nb) is int and 0 < nb <= 64:
                act = a.get("num_bits", 16) if a else 16
                act = act if type(act) is int and 0 < act <= 64 else 16
                scheme = f"W{nb}A{act}"
                return Precision(_int_bits(nb), scheme, "engine")
        if "float-quantized" in fmt:
            return Precision("fp8", "FP8", "engine")
    return None


class PrecisionTable:
    """Per-model precision with operator overrides first; cached per model name."""

    def __init__(
        self, overrides: dict[str, str] | None = None, model_dir: str | None = None
    ) -> None:
        self._overrides = {k: normalise(v) for k, v in (overrides or {}).items()}
        self._cache: dict[str, Precision] = {}
        #: Where vLLM's checkpoints are readable (their config.json), if anywhere.
        self.model_dir = model_dir

    def set_engine(self, model: str, p: Precision | None) -> None:
        """Record what the engine says about a model (used unless overridden)."""
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
