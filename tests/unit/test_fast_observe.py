"""The recorder's fast histogram observation (proxy.measure.metrics.observe) against
prometheus-client's own: same buckets, same sum, same count, same exemplars, for any
values."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.validation import _validate_exemplar

from proxy.measure.metrics import observe
from proxy.measure.recorder import exemplar


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


def _without_time(samples) -> str:
    """The samples with each exemplar's timestamp left out (each observation stamps
    its own)."""
    return repr(
        [
            s._replace(exemplar=s.exemplar._replace(timestamp=None) if s.exemplar else None)
            for s in samples
        ]
    )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10),
            st.text(max_size=300),
            st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
        ),
        max_size=10,
    )
)
def test_observe_with_an_exemplar_exposes_what_the_library_does(values):
    """With an exemplar (one the recorder makes from any request id, traced or not),
    observe() sets the same exemplar on the same bucket as the library, which would
    validate it: the recorder's exemplars always pass that validation, so observe()
    skips it."""

    def histogram() -> Histogram:
        return Histogram(
            "z_seconds", "z", ["a"], buckets=(0.1, 1.0, 5.0), registry=CollectorRegistry()
        )

    ours, theirs = histogram(), histogram()
    for v, request_id, trace_id in values:
        marker = exemplar(request_id, trace_id)
        _validate_exemplar(marker)  # what the library checks on every observation
        observe(ours.labels("1"), v, marker)
        theirs.labels("1").observe(v, marker)
    assert _without_time(ours.collect()[0].samples) == _without_time(theirs.collect()[0].samples)
