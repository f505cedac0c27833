"""The engines' own counters and histograms, re-exported with phasewatch's labels (the
names and their help are :mod:`proxy.measure.metrics`'s, with every other name)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


class EngineSeries:
    """A collector re-exporting the counters and histograms an engine exports about
    itself, with phasewatch's labels, exactly as last scraped (buckets, sums and counts
    untouched; a restarted engine's counters start again from zero, which rate() reads as
    a reset). Another process's histogram cannot go through a prometheus-client
    Histogram, which only observes values; this serves the scraped numbers as they are.

    Under ``--workers N`` the primary scrapes and the others load its snapshot
    (:meth:`snapshot` / :meth:`load`)."""

    def __init__(
        self,
        prefix: str,
        labels: tuple[str, ...],
        counters: dict[str, tuple[str, str]],
        histograms: dict[str, tuple[str, str]],
    ) -> None:
        #: key -> (name without `prefix`, help), as :mod:`proxy.measure.metrics` defines them
        self.prefix, self.labels = prefix, labels
        self.counters, self.histograms = counters, histograms
        self._lock = threading.Lock()
        #: (upstream, model, precision) -> {"counters": {key: v}, "histograms": {key: h}}
        #: with h = [[le, cumulative], ...], sum, count
        self._series: dict[tuple[str, str, str], dict] = {}

    def set(
        self,
        upstream: str,
        series: dict[tuple[str, str], tuple[dict[str, float], dict[str, tuple]]],
    ) -> None:
        """Replace one upstream's series: {(model, precision): (counters, histograms)}."""
        with self._lock:
            for key in [k for k in self._series if k[0] == upstream]:
                del self._series[key]
            for (model, precision), (counters, hists) in series.items():
                self._series[(upstream, model, precision)] = {
                    "counters": {k: v for k, v in counters.items() if k in self.counters},
                    "histograms": {k: v for k, v in hists.items() if k in self.histograms},
                }

    def snapshot(self) -> dict:
        with self._lock:
            return {"series": [[list(k), v] for k, v in self._series.items()]}

    def load(self, doc: dict) -> None:
        items = doc.get("series") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            return
        with self._lock:
            self._series = {
                tuple(k): v
                for k, v in items
                if isinstance(k, list) and len(k) == 3 and isinstance(v, dict)
            }

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            series = list(self._series.items())
        labels = list(self.labels)
        for key, (name, doc) in self.counters.items():
            fam = CounterMetricFamily(self.prefix + name, doc, labels=labels)
            for base, v in series:
                if key in v["counters"]:
                    fam.add_metric(list(base), v["counters"][key])
            yield fam
        for key, (name, doc) in self.histograms.items():
            hfam = HistogramMetricFamily(self.prefix + name, doc, labels=labels)
            for base, v in series:
                h = v["histograms"].get(key)
                if h is None:
                    continue
                buckets, total, _count = h
                hfam.add_metric(
                    list(base),
                    [(_le(le), c) for le, c in buckets],
                    sum_value=total,
                )
            yield hfam

    def describe(self) -> Iterator[Metric]:
        return iter(())


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))
