"""The simulator's command-line flags, shared by ``phasewatch simulate`` and ``demo``."""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import build_app


def add_arguments(parser: argparse.ArgumentParser, realistic: bool = False) -> None:
    """The simulator's flags; `realistic` (the demo): GPU sensors as Ampere-and-later
    GPUs report power, behind a dcgm-exporter collecting every 100 ms, by default."""
    parser.add_argument(
        "--engine",
        choices=("vllm", "ollama", "llamacpp", "sglang", "trtllm"),
        default=os.environ.get("PHASEWATCH_SIM_ENGINE", "vllm"),
        help="Engine wire format to speak [env PHASEWATCH_SIM_ENGINE; default vllm].",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=float(os.environ.get("PHASEWATCH_SIM_SPEED", "1")),
        help="Time scale: 2 runs the simulated GPU twice as fast [default 1].",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=16,
        help="Concurrent sequences per model; more wait in the engine's queue.",
    )
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.02,
        help="Relative standard deviation of step times [default 0.02].",
    )
    parser.add_argument(
        "--truth-log",
        default=os.environ.get("PHASEWATCH_SIM_TRUTH_LOG"),
        help="Append the ground truth of every request (JSON lines) to this file.",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        default=os.environ.get("PHASEWATCH_SIM_DETERMINISTIC", "") not in ("", "0", "false"),
        help="Ids and created times derived from the request, so equal requests "
        "give equal bytes (for byte-equality tests) [env PHASEWATCH_SIM_DETERMINISTIC=1].",
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed.")
    parser.add_argument(
        "--model-dir",
        default=None,
        help="vLLM, SGLang, TensorRT-LLM: write each simulated checkpoint's config.json "
        "under this folder "
        "(for the proxy's --model-dir: KV-cache shapes and precision from the config).",
    )
    parser.add_argument(
        "--ctx-size",
        type=int,
        default=None,
        help="llama-server: context of each slot in tokens, its /props n_ctx (a real "
        "llama-server splits -c over its -np slots) [default 4096, as in the real "
        "captures; 32768 takes the bench's ~16K prompts].",
    )

    parser.add_argument(
        "--served-model",
        default=None,
        help="sglang, trtllm: the one model the server serves, an id of the catalogue "
        "(meta-llama/Llama-3.1-8B-Instruct, RedHatAI/Llama-3.1-8B-Instruct-FP8, "
        "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4) [default the first].",
    )
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="sglang: serve /metrics, as SGLang's own --enable-metrics (off by default, as there).",
    )
    parser.add_argument(
        "--no-alias",
        action="store_true",
        help="llama-server: list the model by its GGUF file's path, as llama-server "
        "started without -a (--alias) does.",
    )
    parser.add_argument(
        "--gpu-sensor",
        choices=("ideal", "instant", "ampere"),
        default=os.environ.get("PHASEWATCH_SIM_GPU_SENSOR", "ampere" if realistic else "ideal"),
        help="How the simulated GPUs' sensors report power: ideal (the true power, every "
        "instant), instant (GA100 and older: instant power, a fast energy counter), ampere "
        "(Ampere and later: a 1 s mean, a 25 ms instant window and an energy counter "
        "refreshed every 100 ms) [env PHASEWATCH_SIM_GPU_SENSOR; default ideal, demo: ampere].",
    )
    parser.add_argument(
        "--dcgm-interval",
        type=float,
        default=float(os.environ.get("PHASEWATCH_SIM_DCGM_INTERVAL", "0.1" if realistic else "0")),
        help="Seconds between the simulated dcgm-exporter's collections (a real one's "
        "default is 30, `-c 100` makes it 0.1); 0: every scrape [default 0, demo: 0.1].",
    )
    parser.add_argument(
        "--dcgm-counters",
        choices=("default", "power"),
        default=os.environ.get("PHASEWATCH_SIM_DCGM_COUNTERS", "power"),
        help="The simulated exporter's counters file: default (dcgm-exporter's own, no "
        "DCGM_FI_DEV_POWER_USAGE_INSTANT) or power (deploy/dcgm/phasewatch-counters.csv, "
        "with it) [default power].",
    )


def from_args(args: argparse.Namespace) -> Any:
    """The simulator's ASGI app for parsed flags; ValueError names a bad flag."""
    if args.speed <= 0:
        raise ValueError("--speed must be positive")
    if args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be at least 1")
    if args.jitter < 0:
        raise ValueError("--jitter must not be negative")
    ctx_size = getattr(args, "ctx_size", None)
    if getattr(args, "dcgm_interval", 0.0) < 0:
        raise ValueError("--dcgm-interval must not be negative")
    if ctx_size is not None and ctx_size < 16:
        raise ValueError("--ctx-size must be at least 16 tokens")
    return build_app(
        args.engine,
        speed=args.speed,
        max_num_seqs=args.max_num_seqs,
        jitter=args.jitter,
        truth_path=args.truth_log,
        seed=args.seed,
        deterministic=args.deterministic,
        model_dir=getattr(args, "model_dir", None),
        ctx_size=ctx_size,
        alias=not getattr(args, "no_alias", False),
        sensor=getattr(args, "gpu_sensor", "ideal"),
        dcgm_interval=getattr(args, "dcgm_interval", 0.0),
        dcgm_instant=getattr(args, "dcgm_counters", "power") == "power",
        served_model=getattr(args, "served_model", None),
        enable_metrics=getattr(args, "enable_metrics", False),
    )
