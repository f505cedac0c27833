"""The floor of our stack: a plain FastAPI + httpx streaming passthrough, no instrumentation.

Same ingredients as phasewatch (uvicorn with uvloop/httptools when installed, one pooled
httpx.AsyncClient, raw bytes streamed back), nothing measured. Used by relay_bench.py.

    python tests/bench/plain_passthrough.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

_DROP = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}


def build(upstream: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(
        base_url=upstream,
        timeout=httpx.Timeout(600.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
    )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(request: Request, path: str):
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _DROP]
        req = client.build_request(
            request.method,
            "/" + path,
            content=body,
            headers=headers,
            params=request.url.query or None,
        )
        resp = await client.send(req, stream=True)
        out = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in resp.headers.raw
            if k.lower() not in _DROP
        }
        return StreamingResponse(
            resp.aiter_raw(),
            status_code=resp.status_code,
            headers=out,
            background=BackgroundTask(resp.aclose),
        )

    return app


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(
        build(upstream),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()
