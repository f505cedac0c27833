"""The bucket bounds of phasewatch's histograms, one tuple per kind of figure.

Apart from :mod:`proxy.measure.metrics` (the names, labels and help texts): the bounds
are tuned to what engines do (how fast decoders emit, how long prompts take). A bound is
part of the exposition too: each is an ``le`` series that dashboards and alerts read.
"""

from __future__ import annotations

#: Latencies (queue, TTFT, prefill, request): 5 ms .. 120 s. Fine below 1 s where
#: interactive TTFT lives, coarse above where long prompts and cold loads live.
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
)

#: Whole-phase durations (decode of a long answer, whole request): 10 ms .. 30 min.
DURATION_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
)

#: Token rates: 1 .. 100,000 tok/s, ten log-spaced steps per decade (the E10 series,
#: ratio ~1.26 between bounds) so quantiles interpolate within a few percent: decode
#: lives in 5..500 tok/s, prefill in 100..50,000 tok/s.
_E10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
RATE_BUCKETS = tuple(round(m * 10**d, 4) for d in range(5) for m in _E10) + (100000.0,)

#: Gaps between output events: 1 ms .. 5 s. vLLM's 10 ms floor is too coarse for fast
#: decoders (a 300 tok/s int4 model emits every ~3 ms).
GAP_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.0125,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
)

#: Time per output token: 0.5 ms .. 2.5 s, ten log-spaced steps per decade (E10) between
#: 1 ms and 100 ms, where every decoder from int4 on an H100 (~3 ms) to a long-context
#: 70B model (~50 ms) lives, so p50/p99 interpolate within a few percent.
TPOT_BUCKETS = (
    (0.0005,)
    + tuple(round(m * 10.0**d, 6) for d in (-3, -2) for m in _E10)
    + (0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
)

#: KV-cache bytes held by one request: 4 KiB .. 256 GiB, one bucket per factor of two
#: (a 1B model's short chat is ~1 MB, a 70B model's 128K-token context ~40 GB).
KV_BYTES_BUCKETS = tuple(float(2**i) for i in range(12, 39))

#: Token counts: powers of two, 1 .. 256K.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(19))

#: Per-request mean GPU power: 10 W .. 1.5 kW.
WATT_BUCKETS = (
    10.0,
    25.0,
    50.0,
    75.0,
    100.0,
    150.0,
    200.0,
    250.0,
    300.0,
    350.0,
    400.0,
    450.0,
    500.0,
    600.0,
    700.0,
    800.0,
    1000.0,
    1200.0,
    1500.0,
)
