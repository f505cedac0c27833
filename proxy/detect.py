"""Which engine an upstream is, what models it serves, and at what precision.

Called from :meth:`proxy.upstreams.Upstream.refresh` (off the request path), at start
and on every model-list refresh. The engine is probed at start and again whenever the
upstream comes back after being down (it may have been replaced by another engine):

- Ollama answers ``GET /api/version`` with ``{"version": ...}``;
- llama-server answers ``GET /props`` with its build and generation settings;
- vLLM answers ``GET /version`` and lists its models ``owned_by: "vllm"``;
- anything else serving ``/v1/models`` is a generic OpenAI-compatible server.

An ``--engine name=...`` override skips the probe. Precision comes from what each engine
says (SPEC §2), read once per model and again when the model list changes.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import TYPE_CHECKING

import httpx

from .precision import (Precision, from_bits_per_weight, from_gguf_file_type, from_gguf_type,
                        from_hf_config, from_llama_ftype, from_name)

if TYPE_CHECKING:
    from .upstreams import Upstream

log = logging.getLogger("phasewatch")

_PROBE_TIMEOUT = 5.0
#: Most bytes read from one answer to the proxy's own probes and scrapes: a broken or
#: hostile engine must not make the proxy hold an unbounded body in memory.
MAX_PROBE_BYTES = 8 * 1024 * 1024


class TooLarge(ValueError):
    """An engine's answer to a probe was longer than MAX_PROBE_BYTES."""


async def read_bounded(client: httpx.AsyncClient, method: str, path: str, body=None,
                       limit: int = MAX_PROBE_BYTES) -> tuple[int, bytes]:
    """(status, body) of a probe, reading at most `limit` bytes (TooLarge beyond)."""
    async with client.stream(method, path, json=body, timeout=_PROBE_TIMEOUT) as resp:
        chunks, size = [], 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"{path} answered more than {limit} bytes")
            chunks.append(chunk)
        return resp.status_code, b"".join(chunks)


async def _json(client: httpx.AsyncClient, method: str, path: str, body=None):
    """(status, parsed JSON or None); raises httpx.HTTPError when nothing answers."""
    try:
        status, raw = await read_bounded(client, method, path, body)
    except TooLarge:
        return 200, None
    try:
        return status, json.loads(raw)
    except (ValueError, RecursionError):
        return status, None


async def detect_engine(client: httpx.AsyncClient) -> str | None:
    """ollama | llamacpp | vllm | openai, or None when the upstream does not answer."""
    try:
        status, obj = await _json(client, "GET", "/api/version")
        if status == 200 and isinstance(obj, dict) and isinstance(obj.get("version"), str):
            return "ollama"
        status, obj = await _json(client, "GET", "/props")
        if status == 200 and isinstance(obj, dict) and (
                "default_generation_settings" in obj or "build_info" in obj
                or "model_path" in obj):
            return "llamacpp"
        status, obj = await _json(client, "GET", "/v1/models")
        models_ok = status == 200 and isinstance(obj, dict)
        if models_ok:
            for item in obj.get("data") or []:
                if isinstance(item, dict):
                    owner = item.get("owned_by")
                    if owner == "vllm":
                        return "vllm"
                    if owner == "llamacpp":
                        return "llamacpp"
        status, obj = await _json(client, "GET", "/version")
        if status == 200 and isinstance(obj, dict) and isinstance(obj.get("version"), str):
            return "vllm"
        return "openai" if models_ok else None
    except httpx.HTTPError:
        return None


async def list_models(u: "Upstream") -> list[str] | None:
    """The upstream's model names (reading their precision on the way), or None when the
    upstream does not answer."""
    try:
        if u.engine == "ollama":
            return await _ollama_models(u)
        if u.engine == "llamacpp":
            return await _llamacpp_models(u)
        return await _openai_models(u)
    except httpx.HTTPError:
        return None


# --- Ollama ---------------------------------------------------------------------------


def ollama_precision(details: dict | None, model_info: dict | None = None) -> Precision | None:
    """Ollama's ``details.quantization_level`` (``Q4_K_M``, ``F16``, ``BF16`` ...), else the
    GGUF ``general.file_type`` of ``/api/show``'s model_info."""
    level = (details or {}).get("quantization_level") if isinstance(details, dict) else None
    if isinstance(level, str) and level and level.lower() != "unknown":
        p = from_gguf_type(level) or from_llama_ftype(level)
        if p is not None:
            return p
        dtype = from_hf_config({"torch_dtype": level})  # safetensors models: a dtype
        if dtype is not None:
            return dtype
    if isinstance(model_info, dict):
        return from_gguf_file_type(model_info.get("general.file_type"))
    return None


async def _ollama_models(u: "Upstream") -> list[str] | None:
    status, obj = await _json(u.client, "GET", "/api/tags")
    if status != 200 or not isinstance(obj, dict):
        return None
    names = []
    for item in obj.get("models") or []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        name = item["name"]
        names.append(name)
        if name not in u.precision_read:
            p = ollama_precision(item.get("details"))
            if p is None:  # ask /api/show (it fills an unknown level from the GGUF)
                s_status, show = await _json(u.client, "POST", "/api/show", {"model": name})
                if s_status == 200 and isinstance(show, dict):
                    p = ollama_precision(show.get("details"), show.get("model_info"))
            _set(u, name, p)
        if len(names) >= u.max_models:
            break
    return names


# --- llama-server -----------------------------------------------------------------------


def llamacpp_precision(props: dict | None, model_entry: dict | None) -> Precision | None:
    """``/props`` model_ftype, ``/v1/models`` meta.ftype, the GGUF type in the model path,
    else bits per weight from ``/v1/models`` meta."""
    props = props if isinstance(props, dict) else {}
    meta = (model_entry or {}).get("meta") if isinstance(model_entry, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    for text in (props.get("model_ftype"), meta.get("ftype")):
        p = from_llama_ftype(text) if isinstance(text, str) else None
        if p is not None:
            return p
    for path in (props.get("model_path"), (model_entry or {}).get("id")):
        if isinstance(path, str):
            p = from_gguf_type(os.path.basename(path))
            if p is not None:
                return p
    return from_bits_per_weight(meta.get("size"), meta.get("n_params"))


async def _llamacpp_models(u: "Upstream") -> list[str] | None:
    status, obj = await _json(u.client, "GET", "/v1/models")
    if status != 200 or not isinstance(obj, dict):
        return None
    entries = [e for e in obj.get("data") or [] if isinstance(e, dict) and isinstance(e.get("id"), str)]
    props = None
    if any(e["id"] not in u.precision_read for e in entries):
        try:
            p_status, props = await _json(u.client, "GET", "/props")
            props = props if p_status == 200 else None
        except httpx.HTTPError:
            props = None
    names = []
    for e in entries[: u.max_models]:
        names.append(e["id"])
        if e["id"] not in u.precision_read:
            # /props describes the loaded model; with one model it is this one
            _set(u, e["id"], llamacpp_precision(props if len(entries) == 1 else None, e))
    return names


# --- vLLM and other OpenAI-compatible servers ---------------------------------------------


def read_model_config(model_dir: str | None, model_id: str, root: str | None) -> dict | None:
    """The checkpoint's ``config.json`` where ``--model-dir`` makes it readable."""
    if not model_dir:
        return None
    candidates = []
    if root and os.path.isabs(root):
        candidates.append(root)
    for name in (model_id, root or ""):
        if name:
            candidates.append(os.path.join(model_dir, name))
            candidates.append(os.path.join(model_dir, os.path.basename(name.rstrip("/"))))
            hub = os.path.join(model_dir, "models--" + name.strip("/").replace("/", "--"), "snapshots")
            candidates.extend(sorted(glob.glob(os.path.join(hub, "*")), reverse=True))
    for folder in candidates:
        path = os.path.join(folder, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                obj = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict):
            return obj
    return None


def openai_precision(model_id: str, root: str | None, model_dir: str | None) -> Precision | None:
    """config.json when readable, else the id, else the root path (``/models/x-AWQ``)."""
    config = read_model_config(model_dir, model_id, root)
    p = from_hf_config(config) if config is not None else None
    if p is not None:
        return p
    p = from_name(model_id)
    if p is None and root:
        p = from_name(root)
    return p


async def _openai_models(u: "Upstream") -> list[str] | None:
    status, obj = await _json(u.client, "GET", "/v1/models")
    if status != 200 or not isinstance(obj, dict):
        return None
    names = []
    for item in obj.get("data") or []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            mid = item["id"]
            names.append(mid)
            if mid not in u.precision_read:
                root = item.get("root") if isinstance(item.get("root"), str) else None
                _set(u, mid, openai_precision(mid, root, u.precision.model_dir))
            if len(names) >= u.max_models:
                break
    return names


def _set(u: "Upstream", model: str, p: Precision | None) -> None:
    u.precision_read.add(model)
    u.precision.set_engine(model, p)  # its source says whether the engine or a name told
