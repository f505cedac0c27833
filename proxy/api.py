"""phasewatch's own API under ``/phasewatch/``: liveness, readiness, the status page and
its summary, a debug view, and OpenAPI docs at ``/phasewatch/docs`` (Swagger UI served
from the package: the docs work offline).

A FastAPI app mounted behind the raw dispatcher (:mod:`proxy.app`): only these few
routes pay for routing and validation; relayed requests never reach it. With proxy keys
set, everything but liveness and readiness needs one (``Authorization: Bearer KEY``,
``x-api-key: KEY``, HTTP Basic with the key as password, which a browser asks for, or
the page cookie that a ``?key=KEY`` link or the login form sets). The key is checked in
:class:`OwnApi` before anything answers, a redirect included; its redirects are relative
references, never built from the ``Host`` header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import html
import posixpath
import typing
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode

import fastapi_offline
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, create_model

from . import __version__
from .core import Access, Relay
from .core.access import COOKIE, Throttled, peer_of, throttled
from .core.answer import Reply
from .core.asgi import Receive, Scope, Send
from .core.refusals import Refusal, Refusals
from .fleet import Upstreams
from .fleet.bridge import bridge_metrics
from .measure.advice import AdviceRow
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
    #: Streams in flight whose output stopped (proxy.services.stall).
    stalled: int = 0


class Readiness(BaseModel):
    ready: bool
    draining: bool
    upstreams: list[UpstreamState]
    #: Ready, but an upstream has stalled streams: `reasons` says which and why.
    degraded: bool = False
    reasons: list[str] = []


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
    stalled: int = 0  # streams in flight whose output stopped (proxy.services.stall)
    stall_reason: str | None = None
    client_held: int = 0  # streams held back by their own clients: never stalls
    #: False: the engine gives no count of what it runs, so its GPU's energy is divided
    #: as if phasewatch relayed every request (None: not known, or power not sampled)
    energy_counted: bool | None = None


class EnergyRow(BaseModel):
    """Energy per token by phase for one upstream x model x precision: each phase is
    ``{joules_per_token, watts, low, high, requests}`` (low/high: the 95 % interval of
    joules_per_token) or ``{unresolved, requests}``."""

    upstream: str
    model: str
    precision: str
    prefill: dict[str, Any]
    decode: dict[str, Any]
    unattributed_joules: float = 0.0


class Summary(BaseModel):
    version: str
    now: float
    uptime_s: float
    simulated: bool = False  # phasewatch demo: engine, GPUs and watts are simulated
    window_s: float
    recent_s: float
    power_sampled: bool
    #: What the GPU power sensor resolves, or why power is not sampled (the page's line).
    power_sensor: list[str] = []
    #: Requests each side a derived figure (speed-up, power saved, J/token) needs.
    min_figure_requests: int = 10
    gpus: list[dict[str, Any]]
    upstreams: list[SummaryUpstream]
    pools: list[dict[str, Any]] = []  # upstreams listing one model, their shares
    bands: dict[str, str]
    rows: list[SummaryRow]
    advice: list[AdviceRow] = []  # proxy.measure.advice: which phase to tune, per row
    energy: list[EnergyRow] = []  # energy per token by phase from many requests
    series: list[dict[str, str]]
    points: list[list[Any]]
    power_points: list[list[Any]]


# --- the app ----------------------------------------------------------------------------


def build_api(
    *,
    relay: Relay,
    upstreams: Upstreams,
    status: StatusPage,
    access: Access,
    energy: typing.Callable[[], list[dict[str, Any]]] | None = None,
) -> OwnApi:
    """The own-API app, wired to the proxy's parts."""
    api = FastAPI(
        title="phasewatch",
        version=__version__,
        description="phasewatch's own routes. Every other path is relayed to the engine unchanged.",
        docs_url=None,  # served below, from the package's Swagger UI (no CDN)
        openapi_url=PREFIX + "/openapi.json",
        redoc_url=None,
        redirect_slashes=False,  # OwnApi redirects, after the key, relative
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
        """Readiness: 503 while no upstream answers, or while draining on SIGTERM;
        ``degraded`` (still 200) while an upstream has stalled streams, with the reasons."""
        reasons = [f"upstream {u.name}: {u.stall_reason}" for u in upstreams.all if u.stalled]
        state = Readiness(
            ready=upstreams.ready and not relay.draining,
            draining=relay.draining,
            upstreams=[
                UpstreamState(
                    name=u.name,
                    url=u.url,
                    engine=u.engine,
                    up=u.up,
                    models=len(u.models),
                    stalled=u.stalled,
                )
                for u in upstreams.all
            ],
            degraded=bool(reasons),
            reasons=reasons,
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
        PREFIX + "/api/advice",
        response_model=list[AdviceRow],
        dependencies=[Depends(key)],
        tags=["status"],
    )
    async def advice() -> list[dict[str, Any]]:
        """Which phase to tune, per upstream x model x precision: the workload, where
        wall time and energy go, the formula checked, and the levers ordered by what
        they would save (the rows of ``phasewatch advise``)."""
        return status.advice()

    @api.get(
        PREFIX + "/api/energy",
        response_model=list[EnergyRow],
        dependencies=[Depends(key)],
        tags=["status"],
    )
    async def energy_rows() -> list[dict[str, Any]]:
        """GPU energy per prompt token (prefill) and per output token (decode), and each
        phase's watts, fitted over the energy counter's steps from many requests, per
        upstream x model x precision; a figure only once its 95 % interval is within
        ±10 %, else why not (empty where GPU power is not sampled, or under --workers N)."""
        return energy() if energy is not None else []

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

    @api.get(PREFIX + "/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=PREFIX + "/openapi.json",
            title="phasewatch — API",
            swagger_js_url=DOCS_ASSETS + "swagger-ui-bundle.js",
            swagger_css_url=DOCS_ASSETS + "swagger-ui.css",
            swagger_favicon_url=DOCS_ASSETS + "favicon.png",
            # no badge fetched from the online validator
            swagger_ui_parameters={"validatorUrl": None},
        )
        page.headers.update(
            {"content-security-policy": _DOCS_CSP, "x-content-type-options": "nosniff"}
        )
        return page

    @api.get(DOCS_ASSETS + "{name}", include_in_schema=False)
    async def docs_asset(name: str) -> Response:
        """Swagger UI's files, from the fastapi-offline package."""
        if name not in _ASSET_TYPES:
            raise HTTPException(404, "no such file")
        return Response(
            _asset(name),
            media_type=_ASSET_TYPES[name],
            headers={"cache-control": "public, max-age=86400", "x-content-type-options": "nosniff"},
        )

    return OwnApi(api, access, relay.refusals)


#: Where the docs page's assets are served (from the fastapi-offline package).
DOCS_ASSETS = PREFIX + "/docs/assets/"
_ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "favicon.png": "image/png",
}
#: Swagger UI 5 (OpenAPI 3.1, as FastAPI writes it), shipped in fastapi-offline's wheel.
_ASSET_DIR = Path(fastapi_offline.__file__).parent / "static"
_assets: dict[str, bytes] = {}


def _asset(name: str) -> bytes:
    if name not in _assets:  # read once, on first use
        _assets[name] = (_ASSET_DIR / name).read_bytes()
    return _assets[name]


_DOCS_CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)

#: Own routes answered without a key: the probes (a trailing slash redirects to them).
OPEN_PATHS = frozenset({PREFIX + "/health", PREFIX + "/ready"})
LOGIN_PATH = PREFIX + "/login"
#: Largest login form body read.
_MAX_LOGIN_BODY = 4096
_UNAUTHORIZED = b'{"detail":"missing or invalid phasewatch API key"}'
_BASIC = (b"www-authenticate", b'Basic realm="phasewatch", charset="UTF-8"')


def relative(base: str, target: str) -> str:
    """A relative reference from the page at path `base` to path `target` (``../docs``
    from ``/phasewatch/docs/``): right behind a gateway that adds a path prefix, and
    never built from the ``Host`` header."""
    base_dir = base[: base.rfind("/") + 1]
    target_dir, name = target[: target.rfind("/") + 1], target[target.rfind("/") + 1 :]
    up = posixpath.relpath(target_dir, base_dir)
    return ("./" if up == "." else up + "/") + name


class OwnApi:
    """The own API behind its gate: the key first (401 before any redirect or route),
    then the ``?key=`` link and the login form that set the page cookie, then a relative
    redirect for a trailing slash, then FastAPI."""

    def __init__(self, app: FastAPI, access: Access, refusals: Refusals) -> None:
        self.app = app
        self.access = access
        self.refusals = refusals
        #: The page cookie's lifetime, in whole seconds (its Max-Age).
        self.max_age = max(1, int(access.page_cookie_ttl))
        self._routes = frozenset(
            getattr(r, "path", "") for r in app.routes if "{" not in getattr(r, "path", "{")
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        raw: str = (scope.get("raw_path") or path.encode()).decode("latin-1")
        open_path = path.rstrip("/") in OPEN_PATHS or not self.access.required
        try:
            if self.access.required and path == LOGIN_PATH and scope["method"] == "POST":
                await self._login(scope, receive, send)
                return
            query = parse_qsl(
                scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
            )
            if self.access.required and not open_path and any(k == "key" for k, _ in query):
                await self._key_link(scope, send, raw, query)
                return
            if not open_path and not self.access.allowed(
                scope["headers"], basic=True, peer=peer_of(scope)
            ):
                await self._unauthorized(scope, send, raw)
                return
        except Throttled as exc:
            refusal = throttled(exc, peer_of(scope), self.access.guesses.per_minute)
            await self.refusals.refuse(Reply(send), refusal)
            return
        if path != PREFIX + "/" and path.endswith("/") and path.rstrip("/") in self._routes:
            qs = scope.get("query_string", b"").decode("latin-1")
            keep = qs and qs.isascii() and qs.isprintable()  # else dropped, not echoed
            target = relative(raw, raw.rstrip("/")) + ("?" + qs if keep else "")
            await _redirect(send, 307, target)
            return
        await self.app(scope, receive, send)

    async def _key_link(
        self, scope: Scope, send: Send, raw: str, query: list[tuple[str, str]]
    ) -> None:
        """``?key=KEY``: a valid key sets the page cookie and redirects to the same page
        without it (the key leaves the address bar); an invalid one is a 401."""
        presented = next(v for k, v in query if k == "key")
        token = self.access.page_cookie(presented.encode("utf-8", "replace"), peer_of(scope))
        if token is None:
            await self._unauthorized(scope, send, raw)
            return
        rest = urlencode([(k, v) for k, v in query if k != "key"])
        target = relative(raw, raw) + ("?" + rest if rest else "")
        await _redirect(send, 303, target, token, self.max_age)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The login form's POST (``key=KEY``, form-encoded): the page cookie and a
        redirect to the status page, or the form again with a 401. A cross-origin post
        is refused before the key is read (see :func:`cross_origin`)."""
        why = cross_origin(scope["headers"])
        if why is not None:
            await self.refusals.refuse(Reply(send), _login_refusal(why))
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if len(body) > _MAX_LOGIN_BODY:
                await _redirect(send, 413, None)
                return
            if not msg.get("more_body"):
                break
        form = dict(parse_qsl(body.decode("latin-1"), keep_blank_values=True))
        presented = form.get("key", "").encode("utf-8", "replace")
        token = self.access.page_cookie(presented, peer_of(scope))
        if token is None:
            await self._unauthorized(scope, send, scope["path"], failed=True)
            return
        raw = scope["path"]
        await _redirect(send, 303, relative(raw, PREFIX + "/"), token, self.max_age)

    async def _unauthorized(self, scope: Scope, send: Send, raw: str, failed: bool = False) -> None:
        """401 with a Basic challenge (a browser's prompt: any user name, the key as
        password); a browser that cancels it sees a login form instead."""
        wants_html = any(k == b"accept" and b"text/html" in v for k, v in scope["headers"])
        if wants_html and scope["method"] in ("GET", "HEAD", "POST"):
            body = _login_page(relative(raw, LOGIN_PATH), failed).encode()
            ctype = b"text/html; charset=utf-8"
        else:
            body, ctype = _UNAUTHORIZED, b"application/json"
        headers = [
            (b"content-type", ctype),
            (b"content-length", str(len(body)).encode()),
            _BASIC,
            (b"cache-control", b"no-store"),
            (b"content-security-policy", _LOGIN_CSP.encode()),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body}
        )


def cross_origin(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a login post is not from the proxy's own page, or None when it is. A browser
    says where a post comes from: ``Sec-Fetch-Site`` (only ``same-origin``, or ``none``
    for one the user made) and ``Origin``, whose host must be the request's ``Host`` (or a
    gateway's ``X-Forwarded-Host``). A
    post in any type but the form's own (``text/plain`` needs no preflight) needs a
    matching ``Origin``; a client that is no browser (no ``Origin``) posts the form type."""
    site = origin = ctype = None
    hosts = []  # the Host, and a gateway's X-Forwarded-Host (a page cannot set either)
    for k, v in headers:
        if k == b"sec-fetch-site":
            site = v.strip().lower()
        elif k == b"origin":
            origin = v.strip().lower()
        elif k in (b"host", b"x-forwarded-host"):
            hosts += [h.strip() for h in v.lower().split(b",")]
        elif k == b"content-type":
            ctype = v.split(b";", 1)[0].strip().lower()
    if site is not None and site not in (b"same-origin", b"none"):
        return "Sec-Fetch-Site is not same-origin"
    matched = False
    if origin is not None:
        _, sep, rest = origin.partition(b"://")
        if not sep or rest.rstrip(b"/") not in hosts:
            return "its Origin is not this proxy"
        matched = True
    if not matched and ctype != b"application/x-www-form-urlencoded":
        return "not a form post, and no Origin of this proxy"
    return None


def _login_refusal(why: str) -> Refusal:
    return Refusal(
        403,
        "a login must come from phasewatch's own login page",
        "permission_denied",
        "login_origin",
        "refused a login post (login_origin): %s",
        (why,),
    )


_LOGIN_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; "
    "frame-ancestors 'none'"
)


def _login_page(action: str, failed: bool) -> str:
    note = "<p class=bad>That key is not valid.</p>" if failed else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>phasewatch — key needed</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px/1.5 system-ui,sans-serif;background:#0f1419;color:#e6edf3;
max-width:34em;margin:12vh auto;padding:0 20px}}input{{font:inherit;padding:6px 8px;
width:100%;margin:8px 0;box-sizing:border-box}}button{{font:inherit;padding:6px 14px}}
.bad{{color:#f85149}}code{{color:#8b98a5}}</style></head><body>
<h1>phasewatch</h1>
<p>This proxy runs with <code>--api-key</code>: its pages need a key. Give one of the
proxy's keys below (it sets a cookie for this browser), or answer the browser's sign-in
prompt with any user name and the key as password, or open
<code>/phasewatch/?key=KEY</code>.</p>{note}
<form method="post" action="{html.escape(action)}">
<label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Open the status page</button>
</form></body></html>
"""


async def _redirect(
    send: Send, status: int, location: str | None, token: str | None = None, max_age: int = 0
) -> None:
    """A redirect to a relative reference (or, without one, an empty answer of
    `status`), setting the page cookie when `token` is given."""
    headers = [(b"content-length", b"0"), (b"cache-control", b"no-store")]
    if location is not None:
        headers.append((b"location", location.encode("latin-1")))
    if token is not None:
        headers.append(
            (
                b"set-cookie",
                f"{COOKIE}={token}; Path=/; Max-Age={max_age}; HttpOnly; SameSite=Strict".encode(),
            )
        )
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


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
