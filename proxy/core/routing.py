"""Routing: where a request goes, read from its path and a peek at the model it names.

Model-management requests are refused first where ``--admin-api`` says so: an engine's
admin paths, and an ordinary request whose body asks the engine to unload its model
(Ollama's ``keep_alive: 0``): refused rather than stripped, since a request is never
silently altered. With one
upstream everything else goes to it. With several: a model list is answered by the
proxy itself (every upstream's merged, :mod:`proxy.core.catalog`); a request that acts
on an engine's own API (Ollama's ``/api/``) goes to an upstream of that engine; any
other goes to the upstream, or the pool of upstreams, serving the model its body (or its
``/v1/models/{model}`` path) names. The engines' own paths and fields come from the
registry: routing names no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engines import MODEL_FIELDS, UNLOAD_FIELDS, is_admin, native_api, unload_field
from ..fleet.pool import PoolDown
from . import catalog
from .refusals import RETRY_AFTER, Refusal, Refused

if TYPE_CHECKING:
    from ..fleet.upstream import Upstream
    from ..fleet.upstreams import Upstreams


@dataclass(slots=True)
class Route:
    """Where a request goes: its upstream, and the other members of its pool, tried in
    order while the request could not be sent (the route moves on as they are tried)."""

    upstream: Upstream
    chain: list[Upstream] = field(default_factory=list)


class Router:
    """Picks each request's route (see the module's docstring)."""

    def __init__(self, upstreams: Upstreams, admin_api: str = "allow") -> None:
        self.upstreams = upstreams
        #: The engines' model-management endpoints: allow, deny, or keyed (a bare proxy
        #: key, one naming no client, may call them).
        self.admin_api = admin_api

    async def route(self, method: str, path: str, body: bytes, key_client: str) -> Route | None:
        """The request's route; None for a model list the proxy answers itself. Raises
        Refused where no upstream may take it. `key_client`: the client a named proxy key
        names ("" when none does). `body`: what to read the model and prompt from (a
        large body's bounded reduction: proxy.core.peek)."""
        if not self.upstreams.probed:  # only the first requests after start
            await self.upstreams.wait_probed()
        if self.admin_api != "allow" and (self.admin_api == "deny" or key_client != ""):
            if is_admin(method, path):
                raise Refused(self._admin_refusal(path))
            if method == "POST" and path in UNLOAD_FIELDS and b"keep_alive" in body:
                field_name = unload_field(path, _json(body))
                if field_name is not None:
                    raise Refused(self._admin_refusal(path, field_name))
        ups = self.upstreams
        if len(ups.all) == 1:
            return Route(ups.all[0])
        if method == "GET" and path in catalog.UNION_PATHS:  # every upstream's models
            return None
        model = peek_model(body) if method == "POST" else catalog.model_in_path(path)
        api = native_api(path) if method in ("POST", "DELETE") else None
        if api is not None:  # an engine's own API: only that engine's upstreams
            prefix, speaker = api
            native = ups.route_native(model if method == "POST" else None, prefix)
            if native is None:  # only engines without that API serve it
                raise Refused(
                    Refusal(
                        404,
                        f"model '{model}' not found",
                        "not_found",
                        shape=lambda st, msg, kind: speaker.error_body(st, msg, kind, path),
                        counted=False,
                        quiet=True,
                    )
                )
            return Route(native)
        try:
            upstream, *chain = ups.choose(model, body)
        except PoolDown as exc:
            raise Refused(
                Refusal(503, str(exc), "unavailable", "pool_down", headers=RETRY_AFTER)
            ) from None
        return Route(upstream, chain)

    def _admin_refusal(self, path: str, field_name: str = "") -> Refusal:
        how = "with a proxy key that names no client" if self.admin_api == "keyed" else ""
        what = (
            f"{field_name} 0 on {path[:100]} unloads the engine's model"
            if field_name
            else f"{path[:100]} manages the engine's models"
        )
        return Refusal(
            403,
            f"{what}; phasewatch refuses it "
            f"(--admin-api {self.admin_api}{': allowed only ' + how if how else ''})",
            "permission_denied",
            "admin_api",
            "refused a request (admin_api): a model-management endpoint (--admin-api %s)",
            (self.admin_api,),
        )


def _json(body: bytes) -> object:
    """A request body as JSON, or None where it is not."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def peek_model(body: bytes) -> str | None:
    """The model a request body names, if it is a JSON object that names one."""
    obj = _json(body)
    if not isinstance(obj, dict):
        return None
    # the first of the engines' model fields present counts (Ollama's older "name")
    model = next((obj[k] for k in MODEL_FIELDS if k in obj), None)
    return model if isinstance(model, str) else None
