"""The built-in engine simulator (a separate subpackage: the relay never imports it)."""

from __future__ import annotations

from .engine import SimEngine
from .physics import DEFAULT_MODELS, ModelSpec


def build_app(
    engine: str = "vllm",
    *,
    speed: float = 1.0,
    max_num_seqs: int = 16,
    jitter: float = 0.02,
    truth_path: str | None = None,
    seed: int = 0,
    deterministic: bool = False,
    model_dir: str | None = None,
    ctx_size: int | None = None,
    alias: bool = True,
    sensor: str = "ideal",
    dcgm_interval: float = 0.0,
    dcgm_instant: bool = True,
    served_model: str | None = None,
    enable_metrics: bool = False,
):
    """An ASGI app simulating `engine`: vllm, ollama or llamacpp (llama-server). With
    `model_dir`, the simulated vLLM's checkpoints' config.json files are written there (a
    proxy reads them with --model-dir); `ctx_size` is llama-server's context per slot
    (default: the real captures' 4096); without `alias`, llama-server lists its model by
    the GGUF file's path, as one started without ``-a`` does. SGLang and TensorRT-LLM
    serve one model each: `served_model` (an id of the catalogue; default its first);
    `enable_metrics`: SGLang's ``--enable-metrics``; TensorRT-LLM's energy monitor."""

    def make(models: tuple[ModelSpec, ...] = DEFAULT_MODELS) -> SimEngine:
        return SimEngine(
            models,
            max_num_seqs=max_num_seqs,
            speed=speed,
            jitter=jitter,
            truth_path=truth_path,
            seed=seed,
            deterministic=deterministic,
            sensor=sensor,
            dcgm_interval=dcgm_interval,
            dcgm_instant=dcgm_instant,
        )

    if engine == "vllm":
        from .vllm import VLLMSim

        if model_dir:
            from .checkpoint import write_hf_configs

            write_hf_configs(DEFAULT_MODELS, model_dir)
        return VLLMSim(make())
    if engine == "ollama":
        from .gguf import OLLAMA_MODELS
        from .ollama import OllamaSim

        return OllamaSim(make(OLLAMA_MODELS))
    if engine == "llamacpp":
        from .gguf import LLAMACPP_MODELS
        from .llamacpp import N_CTX, LlamaServerSim

        return LlamaServerSim(make(LLAMACPP_MODELS), ctx_size or N_CTX, alias)
    if engine in ("sglang", "trtllm"):
        spec = next((m for m in DEFAULT_MODELS if m.id == served_model), None)
        if served_model is not None and spec is None:
            known = ", ".join(m.id for m in DEFAULT_MODELS)
            raise ValueError(f"--served-model must be one of: {known}")
        spec = spec or DEFAULT_MODELS[0]
        if model_dir:
            from .checkpoint import write_hf_configs

            write_hf_configs((spec,), model_dir)
        if engine == "sglang":
            from .sglang import SGLangSim

            return SGLangSim(make((spec,)), enable_metrics=enable_metrics)
        from .trtllm import TRTLLMSim

        return TRTLLMSim(make((spec,)), enable_metrics=enable_metrics)
    raise ValueError(
        f"the simulator does not speak {engine!r} (vllm, ollama, llamacpp, sglang, trtllm)"
    )
