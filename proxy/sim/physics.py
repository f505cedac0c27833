"""The simulator's physics: how long prefill and decode take on a given GPU, per precision.

Decode reads every weight once per step, so a step takes (weight bytes + KV-cache bytes
of the batch's context) / effective memory bandwidth, plus a small per-sequence compute
cost. Prefill is compute-bound: 2 * params FLOPs per prompt token plus the attention
term, over the GPU's effective throughput. Lower precision shrinks the weight bytes a lot
(decode ~3x faster bf16 -> int4) but the matmuls only a little (prefill ~1.3x), and draws
less power: the physics the product makes visible, with an RTX 4090's figures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_gbs: float  # HBM/GDDR bandwidth, GB/s
    tflops_bf16: float  # dense tensor-core throughput
    idle_watts: float
    tdp_watts: float
    memory_gb: float = 24.0


RTX_4090 = GPU("NVIDIA GeForce RTX 4090", 1008.0, 165.0, 22.0, 450.0, 24.0)
H100_SXM = GPU("NVIDIA H100 80GB HBM3", 3350.0, 989.0, 70.0, 700.0, 80.0)


@dataclass(frozen=True)
class PrecisionProfile:
    """How a weight format behaves on the GPU."""

    name: str  # normalised precision label
    quant: str  # raw scheme
    bytes_per_param: float  # including scales/zeros of grouped quantisation
    bandwidth_efficiency: float  # share of peak bandwidth a decode step achieves
    prefill_speedup: float  # prefill throughput relative to bf16
    prefill_watts: float  # draw at full prefill load on an RTX 4090 (scaled by TDP)
    decode_watts: float  # draw at decode load on an RTX 4090 (scaled by TDP)


PROFILES = {
    "bf16": PrecisionProfile("bf16", "BF16", 2.0, 0.80, 1.00, 430.0, 360.0),
    "fp8": PrecisionProfile("fp8", "FP8", 1.03, 0.76, 1.40, 400.0, 300.0),
    "int4": PrecisionProfile("int4", "AWQ", 0.5625, 0.70, 1.30, 390.0, 240.0),
}


@dataclass(frozen=True)
class ModelSpec:
    """One served model: an architecture at one precision."""

    id: str  # served model name (its precision shows in the name, as on vLLM)
    params_b: float  # billions of parameters
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    profile: PrecisionProfile
    max_model_len: int = 32768
    #: the KV cache's element type, as vLLM's --kv-cache-dtype names it ("auto": bf16)
    kv_cache_dtype: str = "auto"

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.profile.bytes_per_param

    @property
    def kv_element_bytes(self) -> float:
        return 1.0 if self.kv_cache_dtype.startswith("fp8") else 2.0

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of every layer: 2 x layers x kv_heads x head_dim x element bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_element_bytes


#: GPU memory vLLM may use (--gpu-memory-utilization) and its KV-cache block size.
GPU_MEMORY_UTILIZATION = 0.9
BLOCK_SIZE = 16


def kv_cache_blocks(model: ModelSpec, gpu_memory_bytes: float) -> int:
    """vLLM's num_gpu_blocks: the memory left after the weights, in blocks of tokens."""
    free = gpu_memory_bytes * GPU_MEMORY_UTILIZATION - model.weight_bytes
    return max(0, int(free // (model.kv_bytes_per_token * BLOCK_SIZE)))


def llama_8b(model_id: str, precision: str, kv_cache_dtype: str = "auto") -> ModelSpec:
    return ModelSpec(
        model_id, 8.03, 32, 8, 128, 4096, PROFILES[precision], kv_cache_dtype=kv_cache_dtype
    )


#: The default catalogue: one 8B model at three precisions (precision visible in the id).
DEFAULT_MODELS = (
    llama_8b("meta-llama/Llama-3.1-8B-Instruct", "bf16"),
    llama_8b("RedHatAI/Llama-3.1-8B-Instruct-FP8", "fp8", kv_cache_dtype="fp8_e4m3"),
    llama_8b("hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4", "int4"),
)

_MFU = 0.45  # share of peak FLOPs a prefill achieves
_PER_SEQ_STEP_S = 0.00015  # sampling/scheduling cost per sequence per decode step


def prefill_seconds(model: ModelSpec, gpu: GPU, new_tokens: int, context_before: int = 0) -> float:
    """Time to process `new_tokens` prompt tokens after `context_before` cached ones."""
    if new_tokens <= 0:
        return 0.0
    dense = 2.0 * model.params_b * 1e9 * new_tokens
    # causal attention: each new token attends to everything before it
    span = context_before * new_tokens + new_tokens * new_tokens / 2.0
    attention = 4.0 * model.layers * model.hidden * span
    flops = gpu.tflops_bf16 * 1e12 * _MFU * model.profile.prefill_speedup
    return (dense + attention) / flops


def decode_step_seconds(model: ModelSpec, gpu: GPU, batch: int, batch_context: int) -> float:
    """One decode step of `batch` sequences holding `batch_context` tokens in total."""
    bytes_read = model.weight_bytes + model.kv_bytes_per_token * batch_context
    bandwidth = gpu.bandwidth_gbs * 1e9 * model.profile.bandwidth_efficiency
    return bytes_read / bandwidth + _PER_SEQ_STEP_S * max(1, batch)


def power_watts(model: ModelSpec, gpu: GPU, state: str, batch: int = 1) -> float:
    """Board power in a state (idle / prefill / decode), scaled to the GPU's TDP."""
    scale = gpu.tdp_watts / RTX_4090.tdp_watts
    if state == "prefill":
        return min(gpu.tdp_watts, model.profile.prefill_watts * scale)
    if state == "decode":
        # bigger batches push the card a little harder, saturating near the prefill draw
        extra = min(1.0, (batch - 1) / 16.0) * (
            model.profile.prefill_watts - model.profile.decode_watts
        )
        return min(gpu.tdp_watts, (model.profile.decode_watts + extra) * scale)
    return gpu.idle_watts
