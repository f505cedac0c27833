"""Feeding the energy-per-token fit (:mod:`proxy.measure.energy_fit`): the sampler's
energy steps and the finished requests of each GPU, kept for :data:`FIT_WINDOW` s, fitted
every :data:`FIT_EVERY` s off the event loop; the rows of ``GET /phasewatch/api/energy``
and the ``energy_*`` gauges.

The fit needs every request that ran on a GPU during a step, so it runs where the sampler
and the requests are in one process (``--workers 1``), and leaves out the steps in which
the engine ran requests this process did not relay; steps after the earliest request
still in flight wait until it has finished.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from ...measure.energy_fit import PHASES, Figure, Step, Work, best_fit, figures
from ...measure.metrics import Metrics

log = logging.getLogger(__name__)

#: How far back steps and requests are kept for the fit (s).
FIT_WINDOW = 600.0
#: How often the fit is recomputed (s).
FIT_EVERY = 5.0
#: The most steps and requests kept per GPU (a bound on memory and on the fit's cost).
MAX_STEPS = 30000
MAX_WORKS = 20000
#: Every this many fits the steps' lag is searched afresh; between, only round the last.
FULL_SEARCH_EVERY = 12
_UNATTRIBUTED = "phasewatch_gpu_unattributed_energy_joules_total"


class EnergyFitter:
    """Steps and requests per GPU in, fitted figures per upstream x model x precision out.

    :meth:`on_step` runs on the sampler's thread, :meth:`on_request` on the event loop
    (the recorder's listener); :meth:`refresh` takes a consistent copy under the lock and
    fits it on a worker thread."""

    def __init__(self, metrics: Metrics, gpus: Any, clock=time.monotonic) -> None:
        self.metrics = metrics
        self.gpus = gpus  # .sampler.GpuMap
        self.clock = clock
        self.lock = threading.Lock()
        self.steps: dict[str, collections.deque[Step]] = {}
        self.shared_steps = 0  # steps left out: the engine ran others' requests in them
        self.works: dict[str, collections.deque[Work]] = {}
        self.figures: dict[tuple[str, str, str], dict[str, Figure]] = {}
        self._task: asyncio.Task[None] | None = None
        self._added = 0  # requests added (a fit runs only when some were)
        self._fitted = 0  # ... as of the last fit
        self._fits = 0
        self._shifts: dict[str, float] = {}  # gpu -> the lag found last
        #: gpu -> end of the newest request dropped for MAX_WORKS: steps before it are
        #: not all known any more
        self._horizon: dict[str, float] = {}
        self._capped = False
        self.serving: dict[str, set[tuple[str, str, str]]] = {}  # gpu -> groups, last fit

    # --- in ------------------------------------------------------------------------------

    def on_step(self, gpu: str, a: float, b: float, joules: float, shared: bool = False) -> None:
        """One step of the GPU's energy; a *shared* one (the engine also ran requests this
        process did not relay) is left out: its work is not known here."""
        if shared:
            self.shared_steps += 1
            return
        with self.lock:
            q = self.steps.get(gpu)
            if q is None:
                q = self.steps[gpu] = collections.deque(maxlen=MAX_STEPS)
            q.append(Step(a, b, joules))

    def on_request(self, ex: Any, f: Any) -> None:
        """Recorder listener: the finished request's work on each GPU that serves it."""
        mk = ex.marks
        if mk.t_sent is None:
            return  # never reached the engine
        end = mk.t_end if mk.t_end is not None else (mk.t_last or mk.t_sent)
        prompt = f.processed_prompt_tokens
        if prompt is None:
            prompt = f.prompt_tokens
        known = (
            ex.prepared.stream
            and mk.t_first is not None
            and prompt is not None
            and f.completion_tokens is not None
        )
        work = Work(
            (ex.upstream_name, ex.model_label, ex.precision),
            mk.t_sent,
            mk.t_first if known else None,
            mk.t_last if known else None,
            end,
            prompt or 0,
            max(0, (f.completion_tokens or 0) - 1),
        )
        with self.lock:
            gpus = list(self.steps)
        for gpu in gpus:
            if self.gpus.serves(gpu, ex):
                with self.lock:
                    q = self.works.get(gpu)
                    if q is None:
                        q = self.works[gpu] = collections.deque(maxlen=MAX_WORKS)
                    if len(q) == q.maxlen:  # the oldest goes: so do the steps it was in
                        self._horizon[gpu] = max(self._horizon.get(gpu, 0.0), q[0].end)
                        if not self._capped:
                            self._capped = True
                            log.info(
                                "energy per token: more than %d requests on GPU %s in %gs; "
                                "the fit keeps the latest %d",
                                MAX_WORKS,
                                gpu,
                                FIT_WINDOW,
                                MAX_WORKS,
                            )
                    q.append(work)
                    self._added += 1

    # --- the fit ---------------------------------------------------------------------------

    def _snapshot(self, now: float) -> dict[str, tuple[list[Step], list[Work]]]:
        """Each GPU's steps and requests of the window, up to the first request still in
        flight (its work is not known yet)."""
        out = {}
        cutoffs = {}
        for gpu in list(self.steps):
            sent = [ex.marks.t_sent for ex in self.gpus.in_flight(gpu) if ex.marks.t_sent]
            cutoffs[gpu] = min(sent, default=now)
        with self.lock:
            for gpu, q in self.steps.items():
                while q and q[0].a < now - FIT_WINDOW:
                    q.popleft()
                works = self.works.get(gpu, collections.deque())
                while works and works[0].end < now - FIT_WINDOW:
                    works.popleft()
                cut = cutoffs.get(gpu, now)
                start = self._horizon.get(gpu, float("-inf"))
                out[gpu] = ([s for s in q if start <= s.a and s.b <= cut], list(works))
        return out

    def fit(self, snap: dict[str, tuple[list[Step], list[Work]]]) -> dict:
        """Fit every GPU of `snap` (blocking: run it off the loop); the figures by group."""
        # the first fits rest on few requests: their lag is searched in full each time
        full = self._fits < FULL_SEARCH_EVERY or self._fits % FULL_SEARCH_EVERY == 0
        self._fits += 1
        solutions = {}
        for gpu, (steps, works) in snap.items():
            sol = best_fit(steps, works, None if full else self._shifts.get(gpu))
            if sol is not None:
                self._shifts[gpu] = sol.shift
            solutions[gpu] = sol
        serving = {gpu: {w.key for w in works} for gpu, (_, works) in snap.items()}
        self.serving = serving
        return figures(solutions, serving)

    async def refresh(self) -> None:
        """Refit, when requests finished since the last fit."""
        added = self._added
        if added == self._fitted:
            return
        snap = self._snapshot(self.clock())
        got = await asyncio.to_thread(self.fit, snap)
        self._fitted = added
        self.figures = got
        self._publish(got)

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(FIT_EVERY)
            try:
                await self.refresh()
            except Exception:
                log.exception("fitting energy per token failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # --- out -------------------------------------------------------------------------------

    def _publish(self, got: dict) -> None:
        m = self.metrics
        for key, phases in got.items():
            for phase in PHASES:
                f: Figure = phases[phase]
                m.gpu_energy_fit_requests.labels(*key, phase).set(f.requests)
                if f.unresolved is not None:  # absent, not zero
                    for bound in ("estimate", "low", "high"):
                        _remove(m.gpu_energy_per_token_joules, key + (phase, bound))
                    _remove(m.gpu_power_fitted_watts, key + (phase,))
                    continue
                for bound, v in (
                    ("estimate", f.joules_per_token),
                    ("low", f.low),
                    ("high", f.high),
                ):
                    if v is not None:
                        m.gpu_energy_per_token_joules.labels(*key, phase, bound).set(v)
                if f.watts is not None:
                    m.gpu_power_fitted_watts.labels(*key, phase).set(f.watts)

    def rows(self) -> list[dict]:
        """``GET /phasewatch/api/energy``: one row per upstream x model x precision."""
        unattributed = _unattributed(self.metrics)
        out = []
        for key, phases in sorted(self.figures.items()):
            row: dict[str, Any] = {"upstream": key[0], "model": key[1], "precision": key[2]}
            for phase in PHASES:
                row[phase] = phases[phase].as_dict()
            row["unattributed_joules"] = sum(
                v for labels, v in unattributed if _matches(labels, key, self.serving)
            )
            out.append(row)
        return out


def _unattributed(metrics: Metrics) -> list[tuple[dict, float]]:
    """The energy counter's samples for requests phasewatch did not relay, where this
    build has that counter (none: nothing to add)."""
    out = []
    for fam in metrics.registry.collect():
        for s in fam.samples:
            if s.name == _UNATTRIBUTED:
                out.append((s.labels, s.value))
    return out


def _matches(labels: dict, key: tuple[str, str, str], serving: dict[str, set]) -> bool:
    """A sample of the group's: its upstream's (and its model's and precision's where it
    names them), or, where it names only a GPU, that GPU's when the group runs there
    alone."""
    if "upstream" not in labels:
        groups = serving.get(labels.get("gpu", ""), set())
        return groups == {key}
    return all(
        labels.get(name) in (None, value)
        for name, value in zip(("upstream", "model", "precision"), key)
    )


def _remove(metric, labels: tuple) -> None:
    try:
        metric.remove(*labels)
    except KeyError:
        pass
