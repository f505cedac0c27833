"""Prometheus reads shared by the kube-play topology tests (test_kube_sidecar.py,
test_kube_replicas.py): instant values, and counters summed at one exact moment.

A GPU's energy counter grows by its idle power even when nothing runs, and Prometheus
scrapes each target at its own moment (later still on a loaded machine), so two counters'
latest samples at one query time describe different moments. :meth:`Prom.counter_at`
interpolates each series between its two samples around the moment instead: the sums
then compare what the counters said at the same instant, to within what a sampler's lag
behind the page holds (idle power times a fraction of a second).
"""

from __future__ import annotations

import httpx

from ..support.prometheus import PromServer

#: Seconds between scrapes; Prometheus 2.42 leaves some targets unscraped at 500 ms.
SCRAPE_S = 1


def attributed(sel: str = "") -> str:
    """Energy the ledger gave requests (series appear with a sidecar's first request)."""
    return f"phasewatch_request_phase_energy_joules_total{sel}"


def idle(sel: str = "") -> str:
    return f"phasewatch_gpu_idle_energy_joules_total{sel}"


def unattributed(sel: str = "") -> str:
    """Energy of requests this phasewatch did not relay (where the ledger knows the
    engine's running count; absent otherwise)."""
    return f"phasewatch_gpu_unattributed_energy_joules_total{sel}"


def seen(sel: str = "") -> str:
    """The GPU counter as phasewatch read it."""
    return f"phasewatch_gpu_energy_joules_total{sel}"


def gpu_counters(sel: str = '{job="engine"}') -> str:
    """The simulated GPUs' own counters (dcgm-exporter's, in mJ)."""
    return f"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{sel}"


class Prom:
    def __init__(self, server: PromServer) -> None:
        self.server = server

    def _query(self, expr: str, at: float | None) -> list[dict]:
        params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
        body = httpx.get(self.server.url + "/api/v1/query", params=params, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        """EXPR's one value (ValueError when it has none: poll() waits on that)."""
        (sample,) = self._query(expr, at)
        return float(sample["value"][1])

    def counter_at(self, selector: str, t: float) -> float:
        """The sum over SELECTOR's series of each one's value at moment T, interpolated
        between its samples around T. A series with no sample before T did not exist yet
        (0: phasewatch's counters start at 0 with their first increment); one with no
        sample after T is an error (query later)."""
        window = 10 * SCRAPE_S
        total = 0.0
        for series in self._query(f"{selector}[{2 * window}s]", t + window):
            points = [(float(ts), float(v)) for ts, v in series["values"]]
            before = [p for p in points if p[0] <= t]
            after = [p for p in points if p[0] > t]
            assert after, f"{series['metric']}: no sample after {t}; query later"
            if not before:
                continue
            (t_a, v_a), (t_b, v_b) = before[-1], after[0]
            total += v_a + (v_b - v_a) * (t - t_a) / (t_b - t_a)
        return total

    def counter_over(self, selector: str, t0: float, t1: float) -> float:
        return self.counter_at(selector, t1) - self.counter_at(selector, t0)
