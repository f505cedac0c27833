"""phasewatch's own API under ``/phasewatch/``: liveness, readiness, the status page and
its summary, a debug view, and OpenAPI docs at ``/phasewatch/docs``.

A FastAPI app mounted behind the raw dispatcher (:mod:`proxy.app`): only these few
routes pay for routing and validation; relayed requests never reach it. With proxy keys
set, everything but liveness and readiness needs one (``Authorization: Bearer KEY``,
``x-api-key: KEY``, or HTTP Basic with the key as password, which a browser asks for).
"""

from __future__ import annotations

import asyncio
import dataclasses
import typing
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, create_model

from . import __version__
from .core import Access, Relay, Upstreams
from .core.bridge import bridge_metrics
from .measure.summary import Row
from .services.status import StatusPage

PREFIX = "/phasewatch"


# --- response models ------------------------------------------------------------------------


class Health(BaseModel):
    status: str = "ok"
    draining: bool = False


class UpstreamState(BaseModel):
    name: str
    url: str
    engine: str
    up: bool | None
    models: int


class Readiness(BaseModel):
    ready: bool
    draining: bool
    upstreams: list[UpstreamState]


class Debug(BaseModel):
    """Counts that show leaks (no request data)."""

    tasks: int
    busy: int
    draining: bool


class Recent(BaseModel):
    requests_per_min: float
    tokens_per_s: float
    ttft_s: float | None
    decode_tok_s: float | None


#: One row of the benchmark table (proxy.measure.summary.Row) plus its recent figures.
SummaryRow: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "SummaryRow",
    **{f.name: (typing.get_type_hints(Row)[f.name], ...) for f in dataclasses.fields(Row)},
    recent=(Recent, ...),
)


class SummaryUpstream(BaseModel):
    name: str
    engine: str
    up: bool | None  # None until its first probe answered or failed
    models: int
    requests: float
    errors: float
    in_flight: float
    queued: float
    watts: float | None
    reason: str | None = None  # why it is down (a refused connection, HTTP 500 on /health)


class Summary(BaseModel):
    version: str
    now: float
    uptime_s: float
    window_s: float
    recent_s: float
    power_sampled: bool
    gpus: list[dict[str, Any]]
    upstreams: list[SummaryUpstream]
    pools: list[dict[str, Any]] = []  # upstreams listing one model, their shares
    bands: dict[str, str]
    rows: list[SummaryRow]
    series: list[dict[str, str]]
    points: list[list[Any]]
    power_points: list[list[Any]]


# --- the app ----------------------------------------------------------------------------


def build_api(*, relay: Relay, upstreams: Upstreams, status: StatusPage, access: Access) -> FastAPI:
    """The own-API app, wired to the proxy's parts."""
    api = FastAPI(
        title="phasewatch",
        version=__version__,
        description="phasewatch's own routes. Every other path is relayed to the engine unchanged.",
        docs_url=PREFIX + "/docs",
        openapi_url=PREFIX + "/openapi.json",
        redoc_url=None,
    )

    def key(request: Request) -> None:
        """With proxy keys set, a key is needed (Bearer, x-api-key or Basic password)."""
        if not access.allowed(request.scope["headers"], basic=True):
            raise HTTPException(
                401,
                "missing or invalid phasewatch API key",
                headers={"www-authenticate": 'Basic realm="phasewatch", charset="UTF-8"'},
            )

    @api.get(PREFIX + "/health", response_model=Health, tags=["probes"])
    async def health() -> Health:
        """Liveness: 200 while the process serves (also while draining)."""
        return Health(draining=relay.draining)

    @api.get(
        PREFIX + "/ready",
        response_model=Readiness,
        tags=["probes"],
        responses={503: {"model": Readiness, "description": "not ready"}},
    )
    async def ready() -> JSONResponse:
        """Readiness: 503 while no upstream answers, or while draining on SIGTERM."""
        state = Readiness(
            ready=upstreams.ready and not relay.draining,
            draining=relay.draining,
            upstreams=[
                UpstreamState(
                    name=u.name, url=u.url, engine=u.engine, up=u.up, models=len(u.models)
                )
                for u in upstreams.all
            ],
        )
        return JSONResponse(state.model_dump(), status_code=200 if state.ready else 503)

    @api.get(
        PREFIX + "/api/summary",
        response_model=Summary,
        dependencies=[Depends(key)],
        tags=["status"],
    )
    async def summary() -> dict[str, Any]:
        """The status page's data: the table per upstream x model x precision, recent
        points for the charts, upstreams and GPUs."""
        return status.summary()

    @api.get(
        PREFIX + "/upstreams/{name}/metrics",
        response_class=PlainTextResponse,
        dependencies=[Depends(key)],
        tags=["status"],
    )
    async def upstream_metrics(name: str) -> PlainTextResponse:
        """One upstream's load under vLLM's gauge names (the router bridge: llm-d's
        endpoint picker and the Gateway API Inference Extension read these), for every
        engine: the engine's own figures where it has them, else phasewatch's."""
        found = next((u for u in upstreams.all if u.name == name), None)
        if found is None:
            raise HTTPException(404, "no upstream of that name")
        return PlainTextResponse(
            bridge_metrics(found), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @api.get(PREFIX + "/debug", response_model=Debug, dependencies=[Depends(key)], tags=["status"])
    async def debug() -> Debug:
        return Debug(tasks=len(asyncio.all_tasks()), busy=relay.busy(), draining=relay.draining)

    @api.api_route(
        PREFIX + "/",
        methods=["GET", "HEAD"],
        response_class=HTMLResponse,
        dependencies=[Depends(key)],
        tags=["status"],
    )
    async def page() -> HTMLResponse:
        """The live status page (also at ``/`` for browsers)."""
        return _page(status)

    @api.api_route(
        PREFIX,
        methods=["GET", "HEAD"],
        response_class=HTMLResponse,
        dependencies=[Depends(key)],
        include_in_schema=False,
    )
    async def page_bare() -> HTMLResponse:
        return _page(status)

    @api.api_route(
        "/",
        methods=["GET", "HEAD"],
        response_class=HTMLResponse,
        dependencies=[Depends(key)],
        include_in_schema=False,
    )
    async def page_root() -> HTMLResponse:
        return _page(status)

    return api


_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def _page(status: StatusPage) -> HTMLResponse:
    return HTMLResponse(
        status.page(),
        headers={
            "vary": "Accept",
            "content-security-policy": _CSP,
            "x-content-type-options": "nosniff",
            "cache-control": "no-store",
        },
    )


def wants_page(scope: dict[str, Any] | Any) -> bool:
    """``GET /`` from a browser (``Accept`` naming text/html) gets the status page; API
    clients still reach the engine's own ``GET /`` (Ollama answers "Ollama is running")."""
    if scope["method"] not in ("GET", "HEAD"):
        return False
    for k, v in scope["headers"]:
        if k == b"accept":
            return b"text/html" in v.lower()
    return False
