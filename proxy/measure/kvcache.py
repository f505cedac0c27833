"""The memory side of the physics: KV-cache bytes per token and per request.

Every generated or prompt token leaves a key and a value vector in every attention layer:
``2 × layers × kv_heads × head_dim × bytes_per_element`` bytes per token. A layer with a
sliding window (Gemma 2/3, Mistral's early models) keeps at most `window` tokens, so a
request of T tokens holds ``2 × kv_heads × head_dim × bytes × (full_layers × T +
sliding_layers × min(T, window))``.

Pure: a model's shape in (from a Hugging Face ``config.json``, or GGUF metadata as
llama.cpp files and Ollama's ``/api/show`` ``model_info`` carry it), figures out. A shape
that cannot be read is None, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes per element of the KV-cache formats the engines offer. GGUF block formats count
#: their scales: q8_0 is 34 bytes per 32 values, q4_0 18, q4_1 20, q5_0 22, q5_1 24.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}

_DTYPE_ALIASES = {
    "float32": "fp32",
    "f32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "f16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "fp8_inc": "fp8",
    "fp8_ds_mla": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def kv_dtype(name: object) -> str | None:
    """The normalised KV-cache element type (``fp16``, ``fp8``, ``q8_0`` ...) or None."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    return key if key in KV_DTYPE_BYTES else None


@dataclass(frozen=True, slots=True)
class KVShape:
    """What a model's KV cache is made of."""

    layers: int  # attention layers holding a KV cache
    kv_heads: int
    head_dim: int  # key width (value width is the same for every model read here)
    sliding_layers: int = 0  # of `layers`, those bounded by a sliding window
    window: int = 0  # tokens a sliding layer keeps
    dtype: str | None = None  # the cache's element type when the model's files say it
    source: str = ""  # config | gguf

    def elements_per_token(self) -> int:
        """K and V elements one token adds when every layer still holds it."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    def bytes_per_token(self, dtype: str) -> float:
        """Full-attention bytes per token: what each token costs while the context is
        within every sliding window (an upper bound beyond it)."""
        return self.elements_per_token() * KV_DTYPE_BYTES[dtype]

    def request_bytes(self, tokens: int, dtype: str) -> float:
        """KV-cache bytes a request of `tokens` tokens holds, sliding windows counted."""
        per_layer_token = 2 * self.kv_heads * self.head_dim * KV_DTYPE_BYTES[dtype]
        full = self.layers - self.sliding_layers
        held = full * tokens
        if self.sliding_layers:
            held += self.sliding_layers * min(tokens, self.window)
        return per_layer_token * held


def _pos_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


# --- Hugging Face config.json (vLLM's checkpoints) --------------------------------------------


def from_hf_config(config: object) -> KVShape | None:
    """The KV shape from a ``config.json``: ``num_hidden_layers``, ``num_key_value_heads``
    (``num_attention_heads`` when absent), ``head_dim`` (else ``hidden_size /
    num_attention_heads``), and sliding layers from ``layer_types`` or
    ``sliding_window_pattern``. Multimodal wrappers keep the language model in
    ``text_config``. Models whose cache is not per-head K and V (MLA: ``kv_lora_rank``)
    have no shape here."""
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config
    if cfg.get("kv_lora_rank") is not None:
        return None
    layers = _pos_int(cfg.get("num_hidden_layers"))
    heads = _pos_int(cfg.get("num_attention_heads"))
    kv_heads = _pos_int(cfg.get("num_key_value_heads")) or heads
    head_dim = _pos_int(cfg.get("head_dim"))
    hidden = _pos_int(cfg.get("hidden_size"))
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    if layers is None or kv_heads is None or head_dim is None:
        return None
    sliding, window = _hf_sliding(cfg, layers)
    dtype = kv_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype"))
    return KVShape(layers, kv_heads, head_dim, sliding, window, dtype, "config")


def _hf_sliding(cfg: dict, layers: int) -> tuple[int, int]:
    """(sliding layers, window) as the config states them; (0, 0) when it does not say
    which layers slide (the figure is then the full-attention upper bound)."""
    window = _pos_int(cfg.get("sliding_window"))
    if window is None or cfg.get("use_sliding_window") is False:
        return 0, 0
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for t in types if t == "sliding_attention"), window
    pattern = _pos_int(cfg.get("sliding_window_pattern"))
    if pattern is not None:  # every pattern-th layer is global (Gemma 3: 6)
        return sum(1 for i in range(layers) if (i + 1) % pattern), window
    return 0, 0


# --- GGUF metadata (llama.cpp files, Ollama's model_info) --------------------------------------

#: llama.cpp's fixed sliding-window patterns for architectures whose files do not carry one:
#: every n-th layer attends globally.
_GGUF_SWA_PATTERN = {"gemma3": 6, "gemma2": 2, "cohere2": 4}


def from_gguf(meta: object) -> KVShape | None:
    """The KV shape from GGUF metadata: ``{arch}.block_count``,
    ``{arch}.attention.head_count_kv`` (``head_count`` when absent), ``key_length`` (else
    ``embedding_length / head_count``), ``sliding_window`` with the architecture's layer
    pattern. The cache's element type is the engine's setting, not the file's: None here."""
    if not isinstance(meta, dict):
        return None
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return None
    layers = _pos_int(meta.get(f"{arch}.block_count"))
    heads = meta.get(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer counts (some hybrid models): not this formula
        return None
    kv_heads = _pos_int(kv_heads)
    head_dim = _pos_int(meta.get(f"{arch}.attention.key_length"))
    embd = _pos_int(meta.get(f"{arch}.embedding_length"))
    if head_dim is None and embd and _pos_int(heads) and embd % heads == 0:  # type: ignore[operator]
        head_dim = embd // heads  # type: ignore[operator]
    if layers is None or kv_heads is None or head_dim is None:
        return None
    window = _pos_int(meta.get(f"{arch}.attention.sliding_window")) or 0
    sliding = 0
    if window:
        flags = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(flags, list) and len(flags) == layers:
            sliding = sum(1 for f in flags if f is True)
        elif arch in _GGUF_SWA_PATTERN:
            n = _GGUF_SWA_PATTERN[arch]
            sliding = sum(1 for i in range(layers) if i % n < n - 1)
    return KVShape(layers, kv_heads, head_dim, sliding, window if sliding else 0, None, "gguf")


@dataclass(frozen=True, slots=True)
class KVModel:
    """One served model's KV cache: its shape (None: unknown) and the element type the
    engine stores it in (None: unknown)."""

    shape: KVShape | None
    dtype: str | None

    @property
    def known(self) -> bool:
        return self.shape is not None and self.dtype is not None

    @property
    def bytes_per_token(self) -> float | None:
        if self.shape is None or self.dtype is None:
            return None
        return self.shape.bytes_per_token(self.dtype)

    def request_bytes(self, tokens: int) -> float | None:
        if self.shape is None or self.dtype is None or tokens < 0:
            return None
        return self.shape.request_bytes(tokens, self.dtype)
