"""The engines' own state, read from what real engines (and the fixtures) serve."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from proxy.engines.llamacpp import GAUGES as _LLAMA
from proxy.engines.llamacpp import slots_state
from proxy.engines.ollama import ollama_ps
from proxy.engines.prometheus import parse_prometheus
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
