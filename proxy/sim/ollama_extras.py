"""What the simulated Ollama offers beside generation: the KV-cache shape in
``/api/show``'s ``model_info`` (the GGUF keys Ollama copies from the model file) and the
embeddings endpoints (fixtures/wire §2): ``/api/embed`` (``embeddings`` with
``prompt_eval_count`` and ns durations), the older ``/api/embeddings`` (one ``embedding``,
no counts) and ``/v1/embeddings`` (OpenAI shape with ``usage``).
"""

from __future__ import annotations

import time

from .asgi import loads, read_body
from .physics import ModelSpec
from .vllm_extras import embed, inputs


def shape_info(spec: ModelSpec, arch: str = "llama") -> dict:
    """The attention keys of a model's ``model_info``."""
    return {
        f"{arch}.attention.head_count": spec.hidden // spec.head_dim,
        f"{arch}.attention.head_count_kv": spec.kv_heads,
        f"{arch}.attention.key_length": spec.head_dim,
        f"{arch}.attention.value_length": spec.head_dim,
        f"{arch}.embedding_length": spec.hidden,
    }


async def embeddings_route(sim, path: str, receive, send, go_json, send_fn) -> None:
    start = time.monotonic_ns()
    obj = loads(await read_body(receive))
    v1 = path == "/v1/embeddings"
    name = obj.get("model") if isinstance(obj, dict) else None
    model = sim._resolve(name) if isinstance(name, str) else None
    if model is None:
        message = f"model '{name}' not found"
        if v1:
            err = {"error": {"message": message, "type": "api_error", "param": None, "code": None}}
            await send_fn(send, 404, go_json(err) + b"\n", b"application/json")
        else:
            await send_fn(send, 404, go_json({"error": message}))
        return
    raw = obj.get("prompt") if path == "/api/embeddings" else obj.get("input")
    texts = inputs(raw)
    if texts is None:
        message = "invalid input type"
        if v1:
            err = {"error": {"message": message, "type": "api_error", "param": None, "code": None}}
            await send_fn(send, 400, go_json(err) + b"\n", b"application/json")
        else:
            await send_fn(send, 400, go_json({"error": message}))
        return
    loaded = time.monotonic_ns()
    await sim._load(model)
    vectors, n = embed(texts)
    if path == "/api/embeddings":
        await send_fn(send, 200, go_json({"embedding": vectors[0]}))
    elif path == "/api/embed":
        now = time.monotonic_ns()
        body = {
            "model": name,
            "embeddings": vectors,
            "total_duration": now - start,
            "load_duration": now - loaded,
            "prompt_eval_count": n,
        }
        await send_fn(send, 200, go_json(body))
    else:
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)
            ],
            "model": name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }
        await send_fn(send, 200, go_json(body) + b"\n", b"application/json")
