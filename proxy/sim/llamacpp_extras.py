"""What the simulated llama-server offers beside generation: its model's GGUF file (the
metadata the real server's ``/props`` ``model_path`` points at) and the embeddings
endpoints of a server started with ``--embeddings``: ``/v1/embeddings`` (OpenAI shape,
``usage.prompt_tokens``), ``/embeddings`` and ``/embedding`` (llama.cpp's own: a list of
``{"index", "embedding": [[...]]}``, no counts).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

from .asgi import loads, read_body
from .checkpoint import gguf_metadata, write_gguf_header
from .gguf import FILE_TYPES
from .physics import ModelSpec
from .vllm_extras import embed, inputs


def model_file(spec: ModelSpec, path: str) -> str:
    """Write the model's GGUF metadata to a private folder under the file name `path`
    has; the folder goes when the simulator exits."""
    folder = tempfile.mkdtemp(prefix="pw-sim-gguf-")
    atexit.register(shutil.rmtree, folder, True)
    out = os.path.join(folder, os.path.basename(path))
    write_gguf_header(out, gguf_metadata(spec, "qwen2", FILE_TYPES[spec.profile.quant]))
    return out


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


async def embeddings_route(sim, path: str, receive, send) -> None:
    """/v1/embeddings (``input``) or the native /embeddings, /embedding (``content``)."""
    obj = loads(await read_body(receive))
    oai = path == "/v1/embeddings"
    raw = None
    if isinstance(obj, dict):
        raw = obj.get("input") if oai or "input" in obj else obj.get("content")
    texts = inputs(raw)
    if texts is None:
        body = {
            "error": {
                "code": 400,
                "message": '"input" must be a string or a list of strings'
                if oai
                else '"content" must be a string or a list of strings',
                "type": "invalid_request_error",
            }
        }
        await _send(send, 400, _dumps(body))
        return
    vectors, n = embed(texts)
    if oai:
        data = [{"embedding": v, "index": i, "object": "embedding"} for i, v in enumerate(vectors)]
        out = {
            "model": sim.alias,
            "object": "list",
            "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": data,
        }
        await _send(send, 200, _dumps(out))
    else:
        await _send(
            send, 200, _dumps([{"index": i, "embedding": [v]} for i, v in enumerate(vectors)])
        )


async def _send(send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"access-control-allow-origin", b""),
                (b"content-type", b"application/json; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
