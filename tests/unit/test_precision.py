"""Precision detection on a table of real model names and engine responses (SPEC §2).

Each row is what an engine really says about a real model: a Hugging Face id or served
path (vLLM), a ``config.json`` quantisation block, an Ollama ``details.quantization_level``
or ``general.file_type``, a llama-server ``model_ftype`` / ``meta.ftype`` / GGUF path.
"""

from __future__ import annotations

import json

import pytest

from proxy.engines.llamacpp import llamacpp_precision
from proxy.engines.ollama import ollama_precision
from proxy.engines.openai import openai_precision, read_model_config
from proxy.measure.precision import (
    PrecisionTable,
    from_bits_per_weight,
    from_hf_config,
    from_llama_ftype,
    from_name,
)

from ..support.replay_wire import LLAMA, WIRE

# --- vLLM: the served id / root path, as the model's publisher named it -------------------------
NAMES = [
    ("RedHatAI/Llama-3.1-8B-Instruct-FP8", "fp8", "FP8"),
    ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", "fp8", "FP8"),
    ("Qwen/Qwen3-8B-FP8", "fp8", "FP8"),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "int4", "AWQ"),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "int4", "AWQ"),
    ("TheBloke/Mistral-7B-Instruct-v0.2-AWQ", "int4", "AWQ"),
    ("casperhansen/llama-3-8b-instruct-awq", "int4", "AWQ"),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "int4", "GPTQ"),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8", "int8", "GPTQ"),
    ("TheBloke/Llama-2-13B-chat-GPTQ", "int4", "GPTQ"),
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "int4", "W4A16"),
    ("RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8", "int8", "W8A8"),
    ("nvidia/Llama-3.1-8B-Instruct-FP4", "fp4", "FP4"),
    ("RedHatAI/Llama-3.3-70B-Instruct-NVFP4", "fp4", "NVFP4"),
    ("unsloth/Llama-3.2-3B-Instruct-bnb-4bit", "int4", "BNB-4bit"),
    ("/models/Llama-3.1-8B-Instruct-BF16", "bf16", "BF16"),  # the simulator's vLLM root
    (
        "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
        "int4",
        "Q4_K_M",
    ),
    ("qwen2.5-7b-instruct-q8_0.gguf", "int8", "Q8_0"),
    ("Meta-Llama-3.1-8B-Instruct-IQ3_XS.gguf", "int3", "IQ3_XS"),
]


@pytest.mark.parametrize("name,precision,quant", NAMES)
def test_names(name, precision, quant):
    p = from_name(name)
    assert (p.precision, p.quant, p.source) == (precision, quant, "name")


@pytest.mark.parametrize(
    "name",
    [
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
        "microsoft/Phi-3-mini-4k-instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "tiny",
    ],
)
def test_names_that_say_nothing(name):
    assert from_name(name) is None  # no guessing: these need config.json or an override


# --- vLLM: config.json (readable with --model-dir) ------------------------------------------------
CONFIGS = [
    ("meta-llama/Llama-3.1-8B-Instruct", {"torch_dtype": "bfloat16"}, "bf16", "BFLOAT16"),
    ("google/gemma-2-9b-it", {"torch_dtype": "float32"}, "fp32", "FLOAT32"),
    ("mistralai/Mistral-7B-Instruct-v0.3", {"dtype": "bfloat16"}, "bf16", "BFLOAT16"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", {"text_config": {"torch_dtype": "float16"}}, "fp16", "FLOAT16"),
    (
        "deepseek-ai/DeepSeek-R1",
        {
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            },
        },
        "fp8",
        "FP8",
    ),
    (
        "openai/gpt-oss-20b",
        {
            "torch_dtype": "bfloat16",
            "quantization_config": {
                "modules_to_not_convert": ["model.layers.*.self_attn"],
                "quant_method": "mxfp4",
            },
        },
        "fp4",
        "MXFP4",
    ),
    (
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        {
            "torch_dtype": "float16",
            "quantization_config": {
                "bits": 4,
                "group_size": 128,
                "quant_method": "awq",
                "version": "gemm",
                "zero_point": True,
            },
        },
        "int4",
        "AWQ",
    ),
    (
        "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int8",
        {
            "quantization_config": {
                "bits": 8,
                "group_size": 128,
                "desc_act": False,
                "quant_method": "gptq",
            }
        },
        "int8",
        "GPTQ",
    ),
    (
        "RedHatAI/Qwen2.5-7B-Instruct-quantized.w8a8",
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {
                            "num_bits": 8,
                            "type": "int",
                            "symmetric": True,
                            "strategy": "channel",
                        },
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            }
        },
        "int8",
        "W8A8",
    ),
    (
        "neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 4, "type": "int", "group_size": 128},
                        "input_activations": None,
                    }
                },
            }
        },
        "int4",
        "W4A16",
    ),
    (
        "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic",
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {
                    "group_0": {
                        "weights": {"num_bits": 8, "type": "float"},
                        "input_activations": {"num_bits": 8, "type": "float"},
                    }
                },
            }
        },
        "fp8",
        "FP8",
    ),
    (
        "RedHatAI/Llama-3.3-70B-Instruct-NVFP4",
        {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}
                },
            }
        },
        "fp4",
        "NVFP4",
    ),
    (
        "nvidia/Llama-3.1-8B-Instruct-FP4",
        {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}},
        "fp4",
        "NVFP4",
    ),
    (
        "unsloth/Llama-3.2-3B-Instruct-bnb-4bit",
        {
            "quantization_config": {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "nf4",
            }
        },
        "int4",
        "BNB-4bit",
    ),
]


@pytest.mark.parametrize("model,config,precision,quant", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_hf_configs(model, config, precision, quant, tmp_path):
    p = from_hf_config(config)
    assert (p.precision, p.quant, p.source) == (precision, quant, "engine")
    # through --model-dir, as the served id's folder (or the HF cache layout)
    folder = tmp_path / model
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    assert read_model_config(str(tmp_path), model, None) == config
    p = openai_precision(model, f"/srv/{model.split('/')[-1]}", str(tmp_path))
    assert (p.precision, p.source) == (precision, "engine")  # the config beats the name


def test_hf_cache_layout(tmp_path):
    snap = tmp_path / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "a09a3545"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert openai_precision("Qwen/Qwen2.5-7B-Instruct", None, str(tmp_path)).precision == "bf16"
    assert openai_precision("Qwen/Qwen2.5-7B-Instruct", None, None) is None


# --- Ollama: details.quantization_level (tags, show, ps) and general.file_type ------------------------
OLLAMA = [
    ("llama3.2:latest", {"quantization_level": "Q4_K_M"}, None, "int4", "Q4_K_M"),
    ("qwen2.5:7b-instruct-q8_0", {"quantization_level": "Q8_0"}, None, "int8", "Q8_0"),
    ("llama3.1:8b-instruct-fp16", {"quantization_level": "F16"}, None, "fp16", "F16"),
    ("llama3.2:3b-instruct-bf16", {"quantization_level": "BF16"}, None, "bf16", "BF16"),
    ("gemma3:27b-it-qat", {"quantization_level": "Q4_0"}, None, "int4", "Q4_0"),
    ("gpt-oss:20b", {"quantization_level": "MXFP4"}, None, "fp4", "MXFP4"),
    ("mistral:7b-instruct-q5_K_M", {"quantization_level": "Q5_K_M"}, None, "int5", "Q5_K_M"),
    ("phi3:3.8b-mini-128k-instruct-q6_K", {"quantization_level": "Q6_K"}, None, "int6", "Q6_K"),
    ("llama3.2:1b-instruct-q3_K_S", {"quantization_level": "Q3_K_S"}, None, "int3", "Q3_K_S"),
    ("llama3.1:70b-instruct-q2_K", {"quantization_level": "Q2_K"}, None, "int2", "Q2_K"),
    ("qwen3:30b-a3b-instruct-2507-fp16", {"quantization_level": "F16"}, None, "fp16", "F16"),
    ("nemotron:nvfp4", {"quantization_level": "NVFP4"}, None, "fp4", "NVFP4"),
    (
        "llama3.2-vision:11b",
        {"quantization_level": "unknown"},
        {"general.file_type": 15},
        "int4",
        "Q4_K_M",
    ),
    ("my-import:latest", {"quantization_level": ""}, {"general.file_type": 7}, "int8", "Q8_0"),
    ("mlx-community/llama:bf16", {"quantization_level": "bfloat16"}, None, "bf16", "BFLOAT16"),
]


@pytest.mark.parametrize("model,details,info,precision,quant", OLLAMA, ids=[o[0] for o in OLLAMA])
def test_ollama(model, details, info, precision, quant):
    p = ollama_precision(details, info)
    assert (p.precision, p.quant, p.source) == (precision, quant, "engine")


def test_ollama_fixtures():
    tags = json.loads((WIRE / "ollama-tags.json").read_text())["models"]
    got = {m["name"]: ollama_precision(m["details"]).precision for m in tags}
    assert got == {"llama3.2:latest": "int4", "qwen2.5:7b-instruct-q8_0": "int8"}
    show = json.loads((WIRE / "ollama-show.json").read_text())
    assert ollama_precision(show["details"], show["model_info"]).quant == "Q4_K_M"
    # quantization_level unknown: the GGUF file type of model_info says it
    assert ollama_precision({"quantization_level": "unknown"}, show["model_info"]).quant == "Q4_K_M"


# --- llama-server: /props model_ftype, /v1/models meta.ftype, the GGUF path, bits per weight ----------
LLAMA_FTYPES = [
    ("Q4_K - Medium", "int4", "Q4_K_M"),
    ("Q4_K - Small", "int4", "Q4_K_S"),
    ("Q5_K - Medium", "int5", "Q5_K_M"),
    ("Q3_K - Large", "int3", "Q3_K_L"),
    ("Q2_K - Medium", "int2", "Q2_K"),
    ("Q6_K", "int6", "Q6_K"),
    ("Q8_0", "int8", "Q8_0"),
    ("all F32", "fp32", "F32"),
    ("F16", "fp16", "F16"),
    ("BF16", "bf16", "BF16"),
    ("IQ4_XS - 4.25 bpw", "int4", "IQ4_XS"),
    ("IQ2_XXS - 2.0625 bpw", "int2", "IQ2_XXS"),
    ("TQ1_0 - 1.69 bpw ternary", "int1", "TQ1_0"),
    ("MXFP4 MoE", "fp4", "MXFP4_MOE"),
    ("Q4_0", "int4", "Q4_0"),
]


@pytest.mark.parametrize("ftype,precision,quant", LLAMA_FTYPES)
def test_llama_ftype_strings(ftype, precision, quant):
    p = from_llama_ftype(ftype)
    assert (p.precision, p.quant) == (precision, quant)
    assert llamacpp_precision({"model_ftype": ftype}, None).quant == quant
    assert llamacpp_precision(None, {"id": "x", "meta": {"ftype": ftype}}).quant == quant


def test_llama_real_captures():
    props = json.loads((LLAMA / "get_props.response.body").read_text())
    models = json.loads((LLAMA / "get_v1_models.response.body").read_text())
    entry = models["data"][0]
    p = llamacpp_precision(props, entry)
    assert (p.precision, p.quant, p.source) == ("int4", "Q4_K_M", "engine")
    # without model_ftype: the GGUF file name in model_path
    p = llamacpp_precision({"model_path": props["model_path"]}, {"id": "gemma-3-270m"})
    assert p.quant == "Q4_K_M"
    # without either: bits per weight from meta (this tiny model keeps its big embedding
    # table at higher precision, so it reads as ~7.4 bits: a last resort, labelled as such)
    p = llamacpp_precision(
        {}, {"id": "gemma-3-270m", "meta": {k: v for k, v in entry["meta"].items() if k != "ftype"}}
    )
    assert p.quant == "7.36bpw" and p.precision == "int8"


@pytest.mark.parametrize(
    "size,params,precision",
    [
        (16.06e9, 8.03e9, "fp16"),
        (8.54e9, 8.03e9, "int8"),
        (4.92e9, 8.03e9, "int4"),
        (3.18e9, 8.03e9, "int3"),
        (32.1e9, 8.03e9, "fp32"),
    ],
)
def test_bits_per_weight(size, params, precision):
    assert from_bits_per_weight(size, params).precision == precision


def test_override_beats_engine_beats_name():
    table = PrecisionTable({"llama3.2:latest": "bf16"})
    table.set_engine("llama3.2:latest", ollama_precision({"quantization_level": "Q4_K_M"}))
    assert table.get("llama3.2:latest").source == "config"
    table.set_engine("m-AWQ", from_hf_config({"torch_dtype": "float16"}))
    assert table.get("m-AWQ").precision == "fp16"  # what the engine loads wins over the name
    assert table.get("x-GPTQ-Int4").source == "name"
    assert table.get("tiny").precision == "unknown"
