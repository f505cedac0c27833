"""The recorder's exemplars (proxy.measure.recorder.exemplar) against prometheus-client's
own validation: a request's observations carry one made from any request id, traced or
not, and the library refuses an invalid one with an exception in the recorder."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from proxy.measure.recorder import exemplar


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=10),
            st.text(max_size=300),
            st.one_of(st.none(), st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_every_exemplar_the_recorder_makes_is_one_the_library_takes(values):
    h = Histogram("z_seconds", "z", ["a"], buckets=(0.1, 1.0, 5.0), registry=CollectorRegistry())
    for v, request_id, trace_id in values:
        h.labels("1").observe(v, exemplar(request_id, trace_id))
    kept = [s.exemplar for s in h.collect()[0].samples if s.exemplar is not None]
    assert kept  # the last observation's bucket holds its exemplar
    for ex in kept:
        assert "request_id" in ex.labels and len("".join([*ex.labels, *ex.labels.values()])) <= 128
