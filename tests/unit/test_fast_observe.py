"""The recorder's fast histogram observation (proxy.measure.metrics.observe) against
prometheus-client's own: same buckets, same sum, same count, for any values."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from proxy.measure.metrics import observe


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=False),
            st.sampled_from([0.0, 0.1, 1.0, 5.0, -0.0, float("inf"), -float("inf")]),
        ),
        max_size=20,
    )
)
def test_observe_fills_the_buckets_the_library_fills(values):
    """observe() finds the bucket by bisection through the same private attributes as
    observe_counts: for any values, bounds themselves and infinities included, a
    histogram observed with it exposes what one observed by the library does."""

    def histogram() -> Histogram:
        return Histogram(
            "z_seconds", "z", ["a"], buckets=(0.1, 1.0, 5.0), registry=CollectorRegistry()
        )

    ours, theirs = histogram(), histogram()
    for v in values:
        observe(ours.labels("1"), v)
        theirs.labels("1").observe(v)
    assert repr(ours.collect()[0].samples) == repr(theirs.collect()[0].samples)
