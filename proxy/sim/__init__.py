"""The built-in engine simulator (a separate subpackage: the relay never imports it)."""

from __future__ import annotations

from .engine import SimEngine


def build_app(engine: str = "vllm", *, speed: float = 1.0, max_num_seqs: int = 16,
              jitter: float = 0.02, truth_path: str | None = None, seed: int = 0,
              deterministic: bool = False):
    """An ASGI app simulating `engine` (vllm; the dialects issue adds ollama, llamacpp)."""
    sim = SimEngine(speed=speed, max_num_seqs=max_num_seqs, jitter=jitter,
                    truth_path=truth_path, seed=seed, deterministic=deterministic)
    if engine == "vllm":
        from .vllm import VLLMSim

        return VLLMSim(sim)
    raise ValueError(f"the simulator does not speak {engine!r} yet (vllm only)")
