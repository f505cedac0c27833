"""KV-cache figures: model shapes read from config.json, GGUF metadata and Ollama's
model_info, each checked against a hand computation of 2 x layers x kv_heads x head_dim x
bytes per element; the GGUF header reader against the ``gguf`` package's reader."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest

from proxy.engines.gguf import GGUFError, read_metadata
from proxy.engines.prometheus import read_metrics
from proxy.engines.vllm import vllm_reading
from proxy.measure.kvcache import KVModel, KVShape, from_gguf, from_hf_config, kv_dtype
from proxy.measure.timeline import EngineTimings, Marks, Usage, figures

from ..support.servers import ROOT

FIXTURES = ROOT / "tests" / "fixtures"


def test_llama_config_hand_computation():
    # Llama 3.1 8B: 32 layers, 8 KV heads of 128 (hidden 4096 / 32 heads), bf16
    cfg = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    }
    shape = from_hf_config(cfg)
    assert shape == KVShape(32, 8, 128, 0, 0, "bf16", "config")
    assert shape.bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert shape.bytes_per_token("fp8") == 65536  # an fp8 cache halves it
    assert shape.request_bytes(1000, "bf16") == 1000 * 131072


def test_mha_config_without_kv_heads_and_mla_is_unknown():
    shape = from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256})
    assert (shape.kv_heads, shape.head_dim, shape.dtype) == (4, 64, None)
    assert from_hf_config({"num_hidden_layers": 2, "kv_lora_rank": 512}) is None
    assert from_hf_config({"num_hidden_layers": 2}) is None
    assert from_hf_config("nonsense") is None


def test_gemma3_config_sliding_layers_hand_computation():
    # Gemma 3 270M: 18 layers, 1 KV head of 256, every 6th layer global, window 512
    base = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_size": 640,
        "sliding_window": 512,
        "torch_dtype": "bfloat16",
    }
    by_pattern = from_hf_config({**base, "sliding_window_pattern": 6})
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    by_types = from_hf_config({**base, "layer_types": types})
    assert by_pattern == by_types
    assert (by_types.sliding_layers, by_types.window) == (15, 512)
    assert by_types.bytes_per_token("bf16") == 2 * 18 * 1 * 256 * 2 == 18432
    # 2000 tokens: 3 global layers hold all of them, 15 sliding ones 512 each
    assert by_types.request_bytes(2000, "bf16") == 2 * 1 * 256 * 2 * (3 * 2000 + 15 * 512)
    assert by_types.request_bytes(300, "bf16") == 300 * 18432  # within the window
    # a window the config says is off does not count
    qwen = from_hf_config({**base, "use_sliding_window": False, "sliding_window_pattern": 6})
    assert qwen.sliding_layers == 0
    # a window with no word on which layers slide: the full-attention upper bound
    assert from_hf_config(base).sliding_layers == 0


def test_multimodal_text_config():
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 34, "num_key_value_heads": 4, "head_dim": 256},
        "torch_dtype": "bfloat16",
    }
    shape = from_hf_config(cfg)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == (34, 4, 256, "bf16")


def test_ollama_model_info_fixture_hand_computation():
    # the real /api/show of llama3.2 3B: 28 blocks, 8 KV heads, key length 128
    show = json.loads((FIXTURES / "wire" / "ollama-show.json").read_text())
    shape = from_gguf(show["model_info"])
    assert shape == KVShape(28, 8, 128, 0, 0, None, "gguf")
    assert shape.bytes_per_token("fp16") == 2 * 28 * 8 * 128 * 2 == 114688
    assert shape.bytes_per_token("q8_0") == 2 * 28 * 8 * 128 * 34 / 32


def test_gguf_gemma3_pattern_and_missing_keys():
    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 18,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.sliding_window": 512,
    }
    shape = from_gguf(meta)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (18, 1, 256)
    assert (shape.sliding_layers, shape.window) == (15, 512)  # llama.cpp: every 6th global
    assert from_gguf({"general.architecture": "gemma3"}) is None
    assert from_gguf({}) is None


def test_kv_dtypes():
    assert kv_dtype("auto") is None
    assert kv_dtype("fp8_e4m3") == kv_dtype("fp8") == "fp8"
    assert kv_dtype("torch.bfloat16") == "bf16"
    assert kv_dtype("f16") == "fp16"
    assert kv_dtype("q4_0") == "q4_0"
    assert kv_dtype(None) is None
    unknown = KVModel(None, "fp16")
    assert unknown.bytes_per_token is None and unknown.request_bytes(10) is None
    assert KVModel(KVShape(1, 1, 1), None).bytes_per_token is None


def test_time_per_output_token_and_context_tokens():
    marks = Marks(t_recv=0.0, t_admit=0.0, t_sent=0.0, t_first=0.5, t_last=2.5, t_end=2.6)
    f = figures(marks, Usage(100, 21), EngineTimings(decode_seconds=1.8, decode_tokens=21))
    assert f.tpot["proxy"] == pytest.approx(2.0 / 20)
    assert f.tpot["engine"] == pytest.approx(1.8 / 20)
    assert f.context_tokens == 121
    # an embeddings answer counts its input, generates nothing: no context held after it
    f = figures(Marks(t_recv=0.0, t_end=0.1), Usage(7, None), streamed=False)
    assert f.context_tokens is None and f.tpot == {}


def test_vllm_cache_config_from_the_real_metrics_page():
    # vLLM 0.32 (CPU) with the README's tiny model: 2 layers, 4 heads of 64, fp32
    text = (FIXTURES / "vllm-real" / "raw-words" / "metrics_after.body").read_text()
    reading = vllm_reading(text, {"tiny"})
    assert reading.gauges["tiny"]["kv_capacity"] == 2048 * 128  # num_gpu_blocks x block_size
    assert reading.kv_dtype == {"tiny": "auto"}  # the model's own dtype
    assert reading.counters["tiny"]["preemptions"] == 0.0
    ttft = reading.histograms["tiny"]["ttft"]
    assert ttft.count == 22 and math.isinf(ttft.buckets[-1][0]) and ttft.buckets[-1][1] == 22
    # the figure phasewatch computes for that model, times vLLM's own token capacity, is
    # vLLM's own kv_cache_memory_bytes
    shape = from_hf_config(
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "hidden_size": 256,
            "torch_dtype": "float32",
        }
    )
    per_token = KVModel(shape, shape.dtype).bytes_per_token
    assert per_token == 2 * 2 * 4 * 64 * 4 == 4096
    labels = read_metrics(text, {}, infos=frozenset({"vllm:cache_config_info"}))[1]
    info = labels["vllm:cache_config_info"][0]
    assert per_token * int(info["kv_cache_size_tokens"]) == int(info["kv_cache_memory_bytes"])


# --- the GGUF header reader, against the gguf package ----------------------------------------


def _write_with_gguf(path, arch: str = "gemma3") -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(18)
    w.add_head_count(4)
    w.add_head_count_kv(1)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_sliding_window(512)
    w.add_embedding_length(640)
    w.add_float32("x.float", 1.5)
    w.add_bool("x.flag", True)
    w.add_int64("x.big", -(2**40))
    w.add_string("x.text", "café ☕")
    w.add_array("x.small", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(10000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(10000)])
    w.add_tensor("t", np.zeros((4, 4), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_reader_agrees_with_the_gguf_package(tmp_path):
    path = tmp_path / "m.gguf"
    _write_with_gguf(path)
    mine = read_metadata(str(path))
    theirs = {name: field.contents() for name, field in gguf.GGUFReader(str(path)).fields.items()}
    for key, value in mine.items():
        if value is None:  # a long array, skipped
            assert len(theirs[key]) > 4096, key
        elif isinstance(value, float):
            assert value == pytest.approx(theirs[key]), key
        else:
            assert value == theirs[key], key
    assert set(theirs) - set(mine) <= {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    shape = from_gguf(mine)
    assert shape.bytes_per_token("fp16") == 18432 and shape.sliding_layers == 15


def test_gguf_reader_refuses_what_is_not_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GGUFError):
        read_metadata(str(bad))
    cut = tmp_path / "cut.gguf"
    _write_with_gguf(cut)
    cut.write_bytes(cut.read_bytes()[:200])
    with pytest.raises(GGUFError):
        read_metadata(str(cut))
    with pytest.raises(OSError):
        read_metadata(str(tmp_path / "missing.gguf"))


def test_report_and_summary_rows_carry_tpot_and_kv():
    from proxy.measure.summary import Samples, build
    from proxy.tools.report import markdown

    base = 'upstream="u",model="m",precision="bf16"'
    lines = [
        f'phasewatch_requests_total{{{base},endpoint="chat",outcome="ok"}} 4',
        f'phasewatch_model_kv_bytes_per_token{{{base},kv_dtype="bf16"}} 131072',
        'phasewatch_model_kv_bytes_per_token{upstream="u",model="x",precision="int4",kv_dtype="unknown"} NaN',
        'phasewatch_requests_total{upstream="u",model="x",precision="int4",endpoint="chat",outcome="ok"} 1',
        f"phasewatch_engine_kv_cache_capacity_tokens{{{base}}} 40000",
    ]
    # 4 requests of 1000 tokens each: 131,072,000 bytes, all in the (2^26, 2^27] bucket
    for le, c in ((2**26, 0), (2**27, 4), ("+Inf", 4)):
        le_text = le if isinstance(le, str) else f"{float(le)}"
        lines.append(f'phasewatch_kv_cache_bytes_bucket{{{base},le="{le_text}"}} {c}')
        lines.append(
            f'phasewatch_time_per_output_token_seconds_bucket{{{base},source="proxy",'
            f'le="{0.01 if le == 2**26 else (0.02 if le == 2**27 else "+Inf")}"}} '
            f"{c}"
        )
    lines += [
        f"phasewatch_kv_cache_bytes_sum{{{base}}} {4 * 131072000}",
        f"phasewatch_kv_cache_bytes_count{{{base}}} 4",
        f'phasewatch_time_per_output_token_seconds_sum{{{base},source="proxy"}} 0.06',
        f'phasewatch_time_per_output_token_seconds_count{{{base},source="proxy"}} 4',
    ]
    rep = build(Samples.from_text("\n".join(lines) + "\n"))
    rows = {r.model: r for r in rep.rows}
    m = rows["m"]
    assert m.kv_bytes_per_token == 131072 and m.kv_dtype == "bf16"
    assert m.kv_request_bytes == 131072000  # the mean lies in the median's bucket
    assert m.tpot_ms == pytest.approx(15.0)
    assert m.kv_capacity_tokens == 40000
    assert m.kv_fit_requests == pytest.approx(40000 * 131072 / 131072000)  # 40 requests
    assert rows["x"].kv_bytes_per_token is None and rows["x"].kv_dtype == "unknown"
    text = markdown(rep)
    assert "| TPOT ms | KV B/tok |" in text
    assert "15.00 | 131,072 (bf16) |" in text
    assert "| u | x | int4 | unknown |" in text
    assert "| 40 |" in text
