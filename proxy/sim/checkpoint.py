"""The simulated models' files, as the real engines' users have them on disk: a Hugging
Face ``config.json`` per vLLM checkpoint, and a GGUF file holding the llama-server model's
metadata (its header only: no tensors). The proxy reads model shapes from exactly these
(``--model-dir`` for vLLM, ``/props`` ``model_path`` for llama-server), so the simulator's
models carry their real shapes through the real reading code.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from .physics import ModelSpec

_QUANT_CONFIG: dict[str, dict[str, Any]] = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "int4": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
}


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """A Llama-style config.json for a simulated checkpoint."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.hidden // spec.head_dim,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_model_len,
        "torch_dtype": "bfloat16" if spec.profile.name != "int4" else "float16",
    }
    quant: dict[str, Any] | None = _QUANT_CONFIG.get(spec.profile.name)
    if quant is not None:
        cfg["quantization_config"] = dict(quant)
    return cfg


def write_hf_configs(models: tuple[ModelSpec, ...] | list[ModelSpec], folder: str) -> None:
    """``folder/<model id>/config.json`` for every model (as a --model-dir holds them)."""
    for spec in models:
        path = os.path.join(folder, spec.id)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config(spec), f, indent=2)


# --- GGUF ---------------------------------------------------------------------------------

_UINT32, _FLOAT32, _STRING, _ARRAY = 4, 6, 8, 9


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value: Any) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", _STRING) + _string(value)
    if isinstance(value, float):
        return struct.pack("<If", _FLOAT32, value)
    if isinstance(value, int):
        return struct.pack("<II", _UINT32, value)
    if isinstance(value, list):  # of strings
        return struct.pack("<IIQ", _ARRAY, _STRING, len(value)) + b"".join(map(_string, value))
    raise TypeError(f"no GGUF encoding for {value!r}")


def gguf_metadata(spec: ModelSpec, arch: str, file_type: int) -> dict[str, Any]:
    """The GGUF keys llama.cpp writes for a Llama-style model."""
    return {
        "general.architecture": arch,
        "general.name": spec.id,
        "general.file_type": file_type,
        f"{arch}.context_length": spec.max_model_len,
        f"{arch}.embedding_length": spec.hidden,
        f"{arch}.block_count": spec.layers,
        f"{arch}.attention.head_count": spec.hidden // spec.head_dim,
        f"{arch}.attention.head_count_kv": spec.kv_heads,
        f"{arch}.attention.key_length": spec.head_dim,
        f"{arch}.attention.value_length": spec.head_dim,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(5000)],  # a vocabulary to skip
    }


def write_gguf_header(path: str, metadata: dict[str, Any]) -> None:
    """A GGUF v3 file holding `metadata` and no tensors."""
    out = [b"GGUF", struct.pack("<IQQ", 3, 0, len(metadata))]
    for key, value in metadata.items():
        out.append(_string(key) + _value(value))
    with open(path, "wb") as f:
        f.write(b"".join(out))
