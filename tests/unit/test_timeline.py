"""Figures from marks: pure functions, no server."""

import pytest

from proxy.measure.metrics import prompt_band
from proxy.measure.timeline import EngineTimings, Marks, Usage, figures


def marks(**kw):
    base = dict(t_recv=10.0, t_admit=10.5, t_sent=10.6, t_first=11.6, t_last=13.6, t_end=13.7)
    base.update(kw)
    return Marks(**base)


def test_streamed_request():
    f = figures(marks(), Usage(prompt_tokens=1000, completion_tokens=101))
    assert f.queue_proxy == pytest.approx(0.5)
    assert f.ttft == pytest.approx(1.6)
    assert f.prefill_seconds == {"proxy": pytest.approx(1.0)}
    assert f.prefill_tps == {"proxy": pytest.approx(1000.0)}
    assert f.decode_seconds == {"proxy": pytest.approx(2.0)}
    assert f.decode_tps == {"proxy": pytest.approx(50.0)}  # (101 - 1) / 2 s
    assert f.request_seconds == pytest.approx(3.7)
    assert f.queue_upstream is None  # the engine reported no prefill time


def test_one_token_has_no_decode_rate():
    f = figures(marks(t_last=11.6), Usage(prompt_tokens=10, completion_tokens=1))
    assert f.decode_tps == {} and f.decode_seconds == {}
    assert f.ttft == pytest.approx(1.6)


def test_cached_prompt_tokens_are_not_processed():
    f = figures(marks(), Usage(prompt_tokens=1000, completion_tokens=5, cached_tokens=800))
    assert f.processed_prompt_tokens == 200
    assert f.prefill_tps["proxy"] == pytest.approx(200.0)


def test_engine_figures_and_upstream_queue():
    engine = EngineTimings(
        prefill_seconds=0.25,
        prefill_tokens=500,
        decode_seconds=1.9,
        decode_tokens=100,
        decode_tokens_per_second=52.6,
    )
    f = figures(marks(), Usage(prompt_tokens=600, completion_tokens=101, cached_tokens=100), engine)
    assert f.prefill_tps == {"engine": pytest.approx(2000.0), "proxy": pytest.approx(500.0)}
    assert f.decode_tps["engine"] == pytest.approx(52.6)
    # (t_first - t_sent) - engine prefill = 1.0 - 0.25
    assert f.queue_upstream == pytest.approx(0.75)


def test_engine_queue_figure_wins():
    f = figures(marks(), Usage(), EngineTimings(queue_seconds=0.3, prefill_seconds=0.2))
    assert f.queue_upstream == pytest.approx(0.3)


def test_non_streamed_never_fakes_a_decode_rate():
    f = figures(
        Marks(t_recv=1.0, t_admit=1.0, t_sent=1.0, t_end=3.0),
        Usage(prompt_tokens=10, completion_tokens=100),
        streamed=False,
    )
    assert f.ttft is None and f.decode_tps == {} and f.prefill_tps == {}
    assert f.request_seconds == pytest.approx(2.0)
    assert f.completion_tokens == 100


def test_aborted_before_first_token():
    f = figures(Marks(t_recv=1.0, t_admit=1.0, t_sent=1.0, t_end=1.5), Usage())
    assert f.ttft is None and f.request_seconds == pytest.approx(0.5)


@pytest.mark.parametrize(
    "tokens,band",
    [
        (None, "unknown"),
        (0, "0-2k"),
        (2047, "0-2k"),
        (2048, "2k-6k"),
        (4096, "2k-6k"),
        (8192, "6k-12k"),
        (16384, "12k-24k"),
        (32768, "24k-64k"),
        (10**6, "64k+"),
    ],
)
def test_prompt_bands(tokens, band):
    assert prompt_band(tokens) == band
