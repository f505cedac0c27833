"""Pools: the upstreams that list one model, formed from their model lists.

Two ``--upstream`` flags whose engines list the same model are a pool of that model; no
setting names pools. A request for a pooled model goes to the member the balancing
policy (:mod:`proxy.fleet.balance`) puts first among those up; the rest are the order in
which a request that could not be sent is tried again (members of the same engine only:
the request was prepared in that engine's dialect). With every member down the request
is refused with a 503 naming the pool, rather than sent to an engine known dead.

The ``pool`` label is the model's label (bounded by the upstreams' labelled models);
``phasewatch_pool_members``, ``phasewatch_pool_members_up`` and
``phasewatch_pool_share`` (each member's share of the pool's recent requests) are set
as members come and go and as requests are picked.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from .balance import Balancer, Load, prefix_key

if TYPE_CHECKING:
    from ..measure.metrics import Metrics
    from .upstream import Upstream

#: Weight of the newest pick in a member's share (about the last 64 requests).
SHARE_ALPHA = 1.0 / 64


class PoolDown(Exception):
    """Every member of the pool serving the request's model is down."""

    def __init__(self, pool: str, members: list[Upstream]) -> None:
        reasons = "; ".join(f"{u.name}: {u.reason or 'down'}" for u in members)
        super().__init__(
            f"every upstream of pool {pool!r} is down ({reasons}); retry when one is back"
        )
        self.pool = pool


class Pools:
    """Pools of the given upstreams, the balancer, and the pool gauges."""

    def __init__(self, upstreams: list[Upstream], balancer: Balancer, metrics: Metrics) -> None:
        self.all = upstreams
        self.balancer = balancer
        self.metrics = metrics
        self._shares: dict[str, dict[str, float]] = {}
        self._published: set[str] = set()
        for u in upstreams:
            u.on_change.append(lambda _u: self.publish())

    def members(self, model: str) -> list[Upstream]:
        return [u for u in self.all if u.serves(model)]

    def pool_name(self, model: str, members: list[Upstream]) -> str:
        """The pool's label: the model's label on its first member (``other`` when no
        member labels it)."""
        return members[0].model_label(model)

    def choose(
        self, model: str | None, body: bytes, among: list[Upstream] | None = None
    ) -> list[Upstream] | None:
        """The members to try for `model`, in order (the first takes the request); None
        when fewer than two upstreams serve it (no pool: the caller routes as before).
        Raises PoolDown when every member is down."""
        if model is None:
            return None
        members = [u for u in (among if among is not None else self.all) if u.serves(model)]
        if len(members) < 2:
            return None
        pool = self.pool_name(model, members)
        alive = [u for u in members if u.up is not False]
        if not alive:
            raise PoolDown(pool, members)
        now = time.monotonic()
        # held back by a 429, or on trial with its one request out: not while others can
        alive = [u for u in alive if u.available(now)] or alive
        # members with stalled streams (proxy.services.stall) take no new request while
        # another member has none
        alive = [u for u in alive if not u.stalled] or alive
        key = None
        if self.balancer.options.affinity == "prefix":
            options = self.balancer.options
            key = prefix_key(body, options.prefix_bytes, options.affinity_secret)
        by_name = {u.name: u for u in alive}
        ordered = [
            by_name[m.name] for m in self.balancer.order(pool, [load(u) for u in alive], key)
        ]
        first = ordered[0]
        first.picked(now)
        self._count(pool, first, members)
        # a retry goes only to members of the same engine (the body is in its dialect)
        return [first, *(u for u in ordered[1:] if u.engine == first.engine)]

    def _count(self, pool: str, picked: Upstream, members: list[Upstream]) -> None:
        if pool not in self._published:
            self.publish()
        shares = self._shares.setdefault(pool, {})
        gauge = self.metrics.pool_share
        for u in members:
            old = shares.get(u.name, 1.0 / len(members))
            new = old + SHARE_ALPHA * ((1.0 if u is picked else 0.0) - old)
            shares[u.name] = new
            gauge.labels(pool, u.name).set(new)

    def publish(self) -> None:
        """Set the members gauges for every pool (a member came, went up or down)."""
        pools: dict[str, list[Upstream]] = {}
        for u in self.all:
            for model in u.models:
                pools.setdefault(model, [])
        for model in list(pools):
            members = self.members(model)
            if len(members) < 2:
                del pools[model]
                continue
            pools[self.pool_name(model, members)] = members
        m = self.metrics
        for pool in self._published - set(pools):
            for g in (m.pool_members, m.pool_members_up):
                try:
                    g.remove(pool)
                except KeyError:
                    pass
        for pool, members in pools.items():
            m.pool_members.labels(pool).set(len(members))
            m.pool_members_up.labels(pool).set(sum(1 for u in members if u.up))
        self._published = set(pools)

    def summary(self) -> list[dict[str, object]]:
        """The pools for the status page."""
        out = []
        for pool in sorted(self._published):
            members = self.members(pool)
            shares = self._shares.get(pool, {})
            out.append(
                {
                    "pool": pool,
                    "members": [
                        {"name": u.name, "up": u.up, "share": round(shares.get(u.name, 0.0), 3)}
                        for u in members
                    ],
                    "up": sum(1 for u in members if u.up),
                }
            )
        return out


def load(u: Upstream) -> Load:
    """What the balancer reads of an upstream now."""
    running, waiting, kv = (
        v if v is not None and math.isfinite(v) and v >= 0 else None for v in u.engine_load
    )
    return Load(
        u.name,
        weight=u.weight,
        in_flight=len(u.active),
        queued=u.gate.queued,
        engine_running=running,
        engine_waiting=waiting,
        kv_usage=kv,
        service_s=u.service_s,
    )
