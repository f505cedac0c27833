"""`phasewatch report`'s arithmetic on hand-made metrics: medians from buckets, model
families, speed-ups against the bf16 row, power and J/token, and 'n/a' without power."""

from __future__ import annotations

import math

from prometheus_client import generate_latest

from proxy.measure.metrics import Metrics
from proxy.measure.summary import MIN_FIGURE_REQUESTS, Samples, build, model_family, quantile
from proxy.tools.report import markdown

BF16 = ("sim", "meta-llama/Llama-3.1-8B-Instruct", "bf16")
FP8 = ("sim", "RedHatAI/Llama-3.1-8B-Instruct-FP8", "fp8")
INT4 = ("sim", "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4", "int4")


def test_quantile_interpolates_like_prometheus():
    # 10 observations: 4 in (0,1], 4 in (1,2], 2 in (2,4]
    buckets = [(1.0, 4), (2.0, 8), (4.0, 10), (math.inf, 10)]
    assert quantile(0.5, buckets) == 1.25  # rank 5: one of four into (1, 2]
    assert quantile(0.9, buckets) == 3.0
    assert quantile(0.5, [(1.0, 0), (math.inf, 3)]) == 1.0  # in +Inf: the largest finite bound
    assert quantile(0.5, [(1.0, 0), (math.inf, 0)]) is None


def test_quantile_uses_the_mean_inside_the_median_bucket():
    # three decode rates of ~397 tok/s in the (315, 400] bucket: interpolation says 357.5,
    # the mean is the true cluster
    buckets = [(315.0, 0), (400.0, 3), (math.inf, 3)]
    assert quantile(0.5, buckets) == 357.5
    assert math.isclose(quantile(0.5, buckets, 3 * 397.0, 3), 397.0)
    # a mean outside the median's bucket (a skewed tail) is not used
    skew = [(1.0, 6), (2.0, 7), (100.0, 10), (math.inf, 10)]
    assert quantile(0.5, skew, 200.0, 10) == 1.0 * 5 / 6


def test_model_family_pairs_precisions_of_one_model():
    fam = {model_family(m) for m in (BF16[1], FP8[1], INT4[1])}
    assert fam == {"llama-3.1-8b-instruct"}
    assert model_family("llama3.1:8b-instruct-q4_K_M") == model_family("llama3.1:8b-instruct-fp16")
    assert model_family("x/qwen2.5-7b-instruct-q4_k_m.gguf") == model_family(
        "x/qwen2.5-7b-instruct-f16.gguf"
    )
    assert model_family("TheBloke/Llama-2-7B-GPTQ") != model_family(
        "meta-llama/Llama-3.1-8B-Instruct"
    )


def _traffic(m: Metrics, key, decode, prefill_tps, ttft_8k, n=MIN_FIGURE_REQUESTS) -> None:
    for i in range(n):
        m.requests_total.labels(*key, "chat", "ok", "unknown").inc()
        m.decode_tokens_per_second.labels(*key, "proxy", "0-2k").observe(
            decode * (1 + 0.01 * (i - (n - 1) / 2))
        )
        m.prefill_tokens_per_second.labels(*key, "proxy", "2k-6k").observe(prefill_tps)
        m.prefill_tokens_per_second.labels(*key, "proxy", "12k-24k").observe(prefill_tps * 0.85)
        m.ttft_seconds.labels(*key, "6k-12k").observe(ttft_8k)
        m.prefill_seconds.labels(*key, "proxy", "2k-6k").observe(1.0)
        m.decode_seconds.labels(*key, "proxy", "0-2k").observe(3.0)
        m.tokens_total.labels(*key, "decode", "unknown").inc(200)


def test_table_without_power_says_na():
    m = Metrics()
    _traffic(m, INT4, 150.0, 5000.0, 1.2)
    _traffic(m, BF16, 50.0, 4000.0, 1.6)
    _traffic(m, FP8, 95.0, 5600.0, 1.1)
    rep = build(Samples.from_text(generate_latest(m.registry).decode()))
    assert [r.precision for r in rep.rows] == ["bf16", "fp8", "int4"]  # the baseline first
    bf16, fp8, int4 = rep.rows
    assert math.isclose(bf16.decode_tok_s, 50.0, rel_tol=0.02)
    assert math.isclose(int4.decode_speedup, 3.0, rel_tol=0.03)
    assert math.isclose(int4.prefill_speedup, 1.25, rel_tol=0.03)
    assert math.isclose(bf16.prefill_ms_per_token["2k-6k"], 0.25, rel_tol=0.03)
    assert math.isclose(bf16.ttft_s["6k-12k"], 1.6, rel_tol=0.03)
    assert bf16.share_prefill == 0.25 and bf16.share_decode == 0.75
    assert bf16.decode_speedup == 1.0 and int4.baseline.endswith("(bf16)")
    assert not rep.power and bf16.decode_watts is None and bf16.joules_per_token_at_decode is None
    text = markdown(rep)
    assert (
        "n/a" in text
        and "3.00×" in text
        and "| sim | meta-llama/Llama-3.1-8B-Instruct | bf16 |" in text
    )


def test_power_per_model_gpu_and_joules_per_token():
    """GPU series labelled with the model they serve (--power-gpu GPU=MODEL)."""
    m = Metrics()
    for key, dec, dw, gpu in ((BF16, 50.0, 360.0, "0"), (INT4, 150.0, 240.0, "2")):
        _traffic(m, key, dec, 5000.0, 1.0)
        for _ in range(MIN_FIGURE_REQUESTS):
            m.gpu_power_watts.labels(*key, "decode").observe(dw)
            m.gpu_power_watts.labels(*key, "prefill").observe(dw + 60)
        for _ in range(10):
            m.gpu_power_sample_watts.labels(*key, gpu, "idle").observe(22.0)
            m.gpu_power_sample_watts.labels(*key, gpu, "decode").observe(dw)
        m.gpu_energy_joules_total.labels(*key, gpu).inc(dw * 10)
    rep = build(Samples.from_registry(m.registry))
    bf16, int4 = rep.rows
    assert rep.power
    assert bf16.decode_watts == 360.0 and int4.decode_watts == 240.0
    assert bf16.idle_watts == 22.0 and int4.idle_watts == 22.0  # its own GPU, not both
    assert math.isclose(bf16.joules_per_token_at_decode, 360.0 / bf16.decode_tok_s)
    assert math.isclose(int4.power_saving, 1 - 240.0 / 360.0)
    assert math.isclose(
        int4.energy_saving, 1 - (240.0 / int4.decode_tok_s) / (360.0 / bf16.decode_tok_s)
    )
    # 10 requests x 200 tokens
    assert math.isclose(int4.joules_per_token_all_in, 2400.0 / (MIN_FIGURE_REQUESTS * 200))
    text = markdown(rep)
    # each derived figure with the requests it rests on, a prefill speed-up with its band
    assert "| 360 | 22 | 7.2" in text and f"33% (n={MIN_FIGURE_REQUESTS})" in text
    assert f"1.00× (n={MIN_FIGURE_REQUESTS}, ~4K)" in text


def test_derived_figures_need_their_minimum_count():
    """A speed-up, a power saving or a J/token resting on fewer than MIN_FIGURE_REQUESTS
    requests is not shown; the row says how many it had, and the report says why."""
    m = Metrics()
    few = MIN_FIGURE_REQUESTS - 1
    _traffic(m, BF16, 50.0, 4000.0, 1.6)
    _traffic(m, INT4, 150.0, 5000.0, 1.2, n=few)
    for key, dw, n in ((BF16, 360.0, MIN_FIGURE_REQUESTS), (INT4, 240.0, few)):
        for _ in range(n):
            m.gpu_power_watts.labels(*key, "decode").observe(dw)
    bf16, int4 = build(Samples.from_registry(m.registry)).rows
    assert bf16.joules_per_token_at_decode is not None
    assert int4.decode_speedup is None and int4.prefill_speedup is None
    assert int4.power_saving is None and int4.joules_per_token_at_decode is None
    assert int4.counts["decode_speedup"] == few and int4.counts["power_saving"] == few
    assert f"on {few} requests; {MIN_FIGURE_REQUESTS} needed" in int4.unresolved["power_saving"]
    assert "(~4K)" in int4.unresolved["prefill_speedup"]
    text = markdown(build(Samples.from_registry(m.registry)))
    assert f"— (n={few})" in text and "Not shown: sim / " in text


def test_power_from_samples_of_an_upstream_serving_one_model():
    """Upstream-wide GPU series (model="all") count for a row only when the upstream
    serves that one model; idle power is the upstream's GPUs' idle power summed."""
    m = Metrics()
    key = ("gpubox", "Qwen/Qwen2.5-7B-Instruct", "bf16")
    _traffic(m, key, 40.0, 3000.0, 2.0)
    for gpu in ("0", "1"):
        for w in (20.0, 24.0):
            m.gpu_power_sample_watts.labels("gpubox", "all", "bf16", gpu, "idle").observe(w)
        for _ in range(MIN_FIGURE_REQUESTS):
            m.gpu_power_sample_watts.labels("gpubox", "all", "bf16", gpu, "decode").observe(300.0)
    rep = build(Samples.from_registry(m.registry))
    (row,) = rep.rows
    assert row.idle_watts == 44.0 and row.decode_watts == 600.0
    assert math.isclose(row.joules_per_token_at_decode, 600.0 / row.decode_tok_s)
    assert row.baseline is not None and row.decode_speedup == 1.0


def test_a_gpu_relabelled_once_is_still_one_gpu():
    """A GPU's series change labels once the engine says what precision its model is
    (unknown first, then bf16): its idle power is the mean of all its idle samples, not the
    sum of the two label sets' means."""
    m = Metrics()
    key = ("sim", "meta-llama/Llama-3.1-8B-Instruct", "bf16")
    _traffic(m, key, 50.0, 4000.0, 1.6)
    early = ("sim", key[1], "unknown", "0")
    for _ in range(3):
        m.gpu_power_sample_watts.labels(*early, "idle").observe(20.0)
    for _ in range(9):
        m.gpu_power_sample_watts.labels(*key, "0", "idle").observe(24.0)
    m.gpu_power_sample_watts.labels("sim", key[1], "bf16", "1", "idle").observe(30.0)
    (row,) = build(Samples.from_registry(m.registry)).rows
    assert math.isclose(row.idle_watts, (3 * 20.0 + 9 * 24.0) / 12 + 30.0)
