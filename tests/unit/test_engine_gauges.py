"""The engines' own state, read from what real engines (and the fixtures) serve."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from proxy.engines.llamacpp import GAUGES as _LLAMA
from proxy.engines.llamacpp import slots_state
from proxy.engines.ollama import ollama_ps
from proxy.engines.prometheus import parse_prometheus
from proxy.engines.sglang import info_precision, sglang_reading
from proxy.engines.trtllm import config_precision, trtllm_reading
from proxy.engines.vllm import GAUGES as _VLLM

from ..support.replay_wire import LLAMA, WIRE


def test_vllm_metrics():
    text = (WIRE / "vllm-metrics-excerpt.prom").read_text()
    assert parse_prometheus(text, _VLLM) == {
        "Qwen/Qwen2.5-7B-Instruct": {"running": 1.0, "waiting": 0.0, "kv": 0.0021}
    }


def test_llama_server_metrics_and_slots():
    text = (LLAMA / "get_metrics_after_traffic.response.body").read_text()
    assert parse_prometheus(text, _LLAMA, "gemma-3-270m") == {
        "gemma-3-270m": {"running": 0.0, "waiting": 0.0}
    }
    idle = json.loads((LLAMA / "get_slots_idle.response.body").read_text())
    # the capture: 4 slots of 4096 tokens (-c 16384 -np 4)
    assert slots_state(idle) == {
        "running": 0.0,
        "slots": 4.0,
        "kv": 0.0,
        "kv_capacity": 4 * 4096.0,
    }
    busy = [
        {
            "id": 0,
            "n_ctx": 4096,
            "is_processing": True,
            "n_prompt_tokens": 1000,
            "next_token": [{"has_next_token": True, "n_remain": 10, "n_decoded": 24}],
        },
        {"id": 1, "n_ctx": 4096, "is_processing": False, "n_prompt_tokens": 3000},
    ]
    assert slots_state(busy) == {
        "running": 1.0,
        "slots": 2.0,
        "kv": 1024 / 8192,
        "kv_capacity": 8192.0,
    }


def test_ollama_ps():
    obj = json.loads((WIRE / "ollama-ps.json").read_text())
    now = datetime(2025, 8, 21, 18, 15, 0, tzinfo=UTC)  # 11:15 -07:00
    got = ollama_ps(obj, now)
    assert got == {
        "llama3.2:latest": {
            "loaded": 1.0,
            "vram": 3565218816.0,
            "size": 3565218816.0,
            "expiry": 200.52981,
        }
    }


# --- SGLang and TensorRT-LLM (tests/fixtures/wire/sglang, trtllm) ----------------------------


def test_sglang_metrics():
    text = (WIRE / "sglang" / "metrics-excerpt.prom").read_text()
    model = "RedHatAI/Llama-3.1-8B-Instruct-FP8"
    assert sglang_reading(text, {model}).gauges == {
        model: {"running": 0.0, "waiting": 0.0, "kv": 0.0}
    }
    # two data-parallel ranks' running requests (summed); a NaN usage is dropped
    busy = (
        f'sglang:num_running_reqs{{dp_rank="0",model_name="{model}"}} 2.0\n'
        f'sglang:num_running_reqs{{dp_rank="1",model_name="{model}"}} 1.0\n'
        f'sglang:num_queue_reqs{{dp_rank="0",model_name="{model}"}} 4.0\n'
        f'sglang:token_usage{{dp_rank="0",model_name="{model}"}} NaN\n'
    )
    got = sglang_reading(busy, {model}).gauges[model]
    assert got == {"running": 3.0, "waiting": 4.0}


def test_sglang_histograms_are_re_exported():
    text = (
        "# TYPE sglang:time_to_first_token_seconds histogram\n"
        'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 2.0\n'
        'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0\n'
        'sglang:time_to_first_token_seconds_sum{model_name="m"} 0.9\n'
        'sglang:time_to_first_token_seconds_count{model_name="m"} 3.0\n'
    )
    h = sglang_reading(text, {"m"}).histograms["m"]["ttft"]
    assert (h.buckets, h.sum, h.count) == ([(0.1, 2.0), (float("inf"), 3.0)], 0.9, 3.0)


def test_trtllm_metrics_and_kv_capacity():
    text = (WIRE / "trtllm" / "prometheus-metrics-excerpt.prom").read_text()
    model = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"
    assert trtllm_reading(text, {model}).gauges == {
        model: {"running": 0.0, "waiting": 0.0, "kv": 0.0, "kv_capacity": 8192.0 * 32}
    }


def test_sglang_server_info_precision():
    cases = {
        ("fp8", "auto"): ("fp8", "FP8"),
        ("awq_marlin", "auto"): ("int4", "AWQ"),
        ("gptq", "float16"): ("int4", "GPTQ"),
        ("w8a8_int8", "auto"): ("int8", "W8A8"),
        ("w8a8_fp8", "auto"): ("fp8", "FP8"),
        ("modelopt_fp4", "auto"): ("fp4", "NVFP4"),
        (None, "bfloat16"): ("bf16", "BFLOAT16"),
        ("", "half"): ("fp16", "HALF"),
    }
    for (quant, dtype), want in cases.items():
        p = info_precision({"quantization": quant, "dtype": dtype, "api_key": "k"})
        assert p is not None and (p.precision, p.quant) == want, (quant, dtype, p)
    for undecided in ({"quantization": None, "dtype": "auto"}, {}, {"quantization": 7}):
        assert info_precision(undecided) is None  # the checkpoint and the name decide


def test_trtllm_model_config_precision():
    cases = {
        ("FP8", "bfloat16"): "fp8",
        ("FP8_BLOCK_SCALES", "bfloat16"): "fp8",
        ("NVFP4", "bfloat16"): "fp4",
        ("W4A16_AWQ", "float16"): "int4",
        ("W4A8_AWQ", "float16"): "int4",
        ("W8A8_SQ_PER_CHANNEL", "float16"): "int8",
        ("none", "bfloat16"): "bf16",
        (None, "float16"): "fp16",
    }
    for (quant, dtype), want in cases.items():
        p = config_precision(quant, dtype)
        assert p is not None and p.precision == want, (quant, dtype, p)
    assert config_precision(None, "auto") is None and config_precision("", None) is None
