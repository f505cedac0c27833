"""The fleet: every upstream, a request's upstream chosen by model (a pool's members in
the balancer's order), and each upstream's background work: engine detection and model
lists, health probes, and under --workers N the primary's view shared with the others.
Each upstream on its own is :mod:`proxy.fleet.upstream`."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from .balance import BalanceOptions, Balancer
from .host import Board, Host
from .pool import Pools
from .supervisor import every
from .upstream import Upstream

log = logging.getLogger(__name__)

#: Longest a request waits at start for the upstreams' first probes.
FIRST_PROBE_WAIT = 5.0


class Upstreams:
    """All upstreams, routing by model, and their background refresh."""

    def __init__(self, upstreams: list[Upstream], balance: BalanceOptions | None = None) -> None:
        if not upstreams:
            raise ValueError("at least one upstream is needed")
        self.all = upstreams
        #: Upstreams listing one model form its pool (proxy.fleet.pool).
        self.pools = Pools(upstreams, Balancer(balance or BalanceOptions()), upstreams[0].metrics)
        self._tasks: list[asyncio.Task[None]] = []
        #: True once every upstream's first probe is done (or was waited for long enough).
        self.probed = False
        self._last_states: dict[str, Any] = {}

    @property
    def ready(self) -> bool:
        """Whether any upstream answered its last probe."""
        return any(u.up for u in self.all)

    async def wait_probed(self, timeout: float = FIRST_PROBE_WAIT) -> None:
        """Wait (at most `timeout`, once) for every upstream's first probe, so the first
        requests after start are routed by model and read in the right dialect."""
        try:
            await asyncio.wait_for(asyncio.gather(*(u.probed.wait() for u in self.all)), timeout)
        except TimeoutError:
            pass
        self.probed = True

    def route(self, model: str | None) -> Upstream:
        """The upstream serving `model`; the first one when none lists it."""
        if len(self.all) > 1 and model is not None:
            for u in self.all:
                if u.serves(model):
                    return u
        return self.all[0]

    def choose(self, model: str | None, body: bytes) -> list[Upstream]:
        """The upstreams to try for a request, in order: a pool's members as the balancer
        orders them, else the one upstream serving `model` (the first when none does).
        Raises PoolDown when every member of the model's pool is down."""
        ordered = self.pools.choose(model, body)
        return ordered if ordered is not None else [self.route(model)]

    def route_native(self, model: str | None, prefix: str) -> Upstream | None:
        """The upstream for a request on an engine's own API (Ollama's ``/api/…``, its
        path `prefix`): an upstream of that engine serving `model`, else the first
        upstream of that engine (it answers for models it does not have: pulls, its own
        "not found"). None when only engines without that API serve `model`: the client
        could not use their answer, so the relay says "not found" in that API's shape
        rather than pass on the engine's unrelated 404."""
        native = [u for u in self.all if u.dialect.native_prefix == prefix]
        pooled = self.pools.choose(model, b"", among=native) if len(native) > 1 else None
        if pooled:
            return pooled[0]
        for u in native:
            if u.serves(model):
                return u
        if any(u.serves(model) for u in self.all):
            return None
        return native[0] if native else self.route(model)

    def start(self, refresh_interval: float, host: Host | None = None) -> None:
        """Detect each engine and read its models now, then every `refresh_interval`,
        in the background: the proxy serves from the first moment. Under --workers N only
        the primary probes; the others take its results from a shared board."""
        for u in self.all:
            u.publish_models()
        board = Board(host.path("upstreams.json")) if host is not None else None
        if host is not None and not host.primary:
            assert board is not None
            self.spawn(every(0.5, lambda: self._follow(board), "reading the primary's upstreams"))
            return
        for u in self.all:
            self.spawn(
                every(
                    refresh_interval,
                    functools.partial(self._refresh, u, board),
                    f"model-list refresh of upstream {u.name}",
                    next_delay=functools.partial(u.next_probe_delay, refresh_interval),
                )
            )
            if u.options.health_interval > 0:
                self.spawn(self._health(u, board))

    async def _health(self, u: Upstream, board: Board | None) -> None:
        """The upstream's health loop: a probe when idle, probes back when ejected."""
        failing = False
        while True:
            was = (u.up, u.reason)
            try:
                delay = await u.health_step()
            except asyncio.CancelledError:
                raise
            except Exception:
                if not failing:
                    log.exception("health probe of upstream %s failed", u.name)
                failing = True
                delay = u.options.health_backoff_max
            else:
                failing = False
            if board is not None and (u.up, u.reason) != was:
                board.write({"upstreams": {x.name: x.state() for x in self.all}})
            u.wake.clear()
            try:
                await asyncio.wait_for(u.wake.wait(), max(delay, 0.01))
            except TimeoutError:
                pass

    async def _refresh(self, u: Upstream, board: Board | None) -> None:
        try:
            await u.refresh()
        finally:
            if board is not None:
                board.write({"upstreams": {x.name: x.state() for x in self.all}})

    async def _follow(self, board: Board) -> None:
        doc = board.read_if_changed()
        states = doc.get("upstreams") if doc else None
        if isinstance(states, dict):
            self._last_states = states
        now = time.monotonic()
        for u in self.all:
            state = self._last_states.get(u.name)
            if not isinstance(state, dict):
                continue
            # an upstream this worker ejected takes the primary's view again once its
            # backoff is over (the primary probes it for every worker)
            if states is not None or (u.up is False and now >= u.retry_at and state.get("up")):
                u.apply(state)

    def spawn(self, coro) -> None:
        self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(u.aclose() for u in self.all), return_exceptions=True)
