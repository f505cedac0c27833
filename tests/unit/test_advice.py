"""The advice's arithmetic on hand-made metrics: shares of wall time, the formula, the
levers' order and figures, energy shares from power samples, and silence on too little
traffic (proxy.measure.advice: figures in, rows out)."""

from __future__ import annotations

import math

from prometheus_client import generate_latest

from proxy.measure.advice import MIN_BATCH_REQUESTS, MIN_REQUESTS, advise
from proxy.measure.metrics import Metrics, prompt_band
from proxy.measure.summary import Sample, Samples, build
from proxy.tools.report import advice_markdown

BF16 = ("gpu", "meta-llama/Llama-3.1-8B-Instruct", "bf16")
FP8 = ("gpu", "RedHatAI/Llama-3.1-8B-Instruct-FP8", "fp8")
INT4 = ("gpu", "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4", "int4")


def traffic(m, key, n, prompt, out, prefill_s, decode_s, queue_s=0.0, stream=True, watts=None):
    band = prompt_band(prompt)
    for _ in range(n):
        m.requests_total.labels(*key, "chat", "ok", "unknown").inc()
        m.queue_seconds.labels(*key, "proxy").observe(queue_s)
        m.prompt_tokens.labels(*key).observe(prompt)
        m.completion_tokens.labels(*key).observe(out)
        m.tokens_total.labels(*key, "prefill", "unknown").inc(prompt)
        m.tokens_total.labels(*key, "decode", "unknown").inc(out)
        m.request_seconds.labels(*key, "chat", "ok").observe(queue_s + prefill_s + decode_s)
        if not stream:
            continue
        m.ttft_seconds.labels(*key, band).observe(queue_s + prefill_s)
        m.prefill_seconds.labels(*key, "proxy", band).observe(prefill_s)
        m.prefill_tokens_per_second.labels(*key, "proxy", band).observe(prompt / prefill_s)
        m.decode_seconds.labels(*key, "proxy", band).observe(decode_s)
        m.decode_tokens_per_second.labels(*key, "proxy", band).observe((out - 1) / decode_s)
        if watts:
            m.gpu_power_watts.labels(*key, "decode").observe(watts)


def rows(m, extra=()):
    samples = Samples.from_text(generate_latest(m.registry).decode())
    if extra:
        samples = Samples([s for v in samples.by_name.values() for s in v] + list(extra))
    return {a.precision: a for a in advise(samples, build(samples))}


def test_the_issues_rag_example_prefill_dominates_and_shorter_prompts_come_first():
    # 12,000-token prompts at 1,500 tok/s: 8 s of prefill; 24 tokens at 40 tok/s; 7.5 s queued
    m = Metrics()
    traffic(m, BF16, 40, 12000, 24, 8.0, 23 / 40, queue_s=7.5)
    a = rows(m)["bf16"]
    assert a.enough and a.requests == 40 and a.workload == "document analysis"
    assert a.dominant_phase == "prefill"
    total = 7.5 + 8.0 + 23 / 40
    assert math.isclose(a.shares["prefill"], 8.0 / total)
    assert math.isclose(a.formula["predicted_s"], 12000 / 1500 + 23 / 40, rel_tol=0.01)
    assert math.isclose(a.formula["ratio"], 1.0, rel_tol=0.01)
    # the dominant phase's levers first (halving the prompt: 4 s of TTFT), then the others
    # by what they would save (the 7.5 s queue)
    first, cache, queue = a.levers[:3]
    assert (first.lever, first.phase, first.measured) == ("shorter_prompts", "prefill", True)
    assert cache.lever == "prefix_caching"
    assert queue.lever == "queueing" and math.isclose(queue.expected_effect.seconds, 7.5)
    assert math.isclose(first.expected_effect.seconds, 4.0, rel_tol=0.01)
    assert "halving the median prompt saves 4.00 s of TTFT" in first.expected_effect.summary
    assert "over 40 requests" in first.evidence and "1,500 tok/s" in first.evidence
    # a quarter of each prompt from cache: a quarter of the mean prefill time, and the
    # median prompt's quarter (3,000 tokens at 1,500 tok/s) beside it
    assert math.isclose(cache.expected_effect.seconds, 8.0 / 4)
    assert "saves a quarter of the prefill time, 2.00 s of TTFT" in cache.expected_effect.summary
    assert "the median prompt, 3,000 tokens, saves 2.00 s" in cache.expected_effect.summary
    assert a.energy["shares"] is None and "unavailable" in a.energy["note"]


def test_too_little_traffic_gets_no_levers():
    m = Metrics()
    traffic(m, BF16, MIN_REQUESTS - 1, 12000, 24, 8.0, 0.6)
    a = rows(m)["bf16"]
    assert not a.enough and a.levers == []
    # the shares are shown (the figures, with their count); no verdict, no recommendation
    assert a.shares["prefill"] > 0.9 and a.dominant_phase is None
    assert f"only {MIN_REQUESTS - 1} measured requests" in a.note


def test_a_served_lower_precision_is_measured_not_typical():
    m = Metrics()
    traffic(m, BF16, 40, 150, 400, 0.05, 399 / 50, watts=360.0)
    traffic(m, INT4, 40, 150, 400, 0.04, 399 / 150, watts=240.0)
    got = rows(m)
    a = got["bf16"]
    assert a.workload == "interactive chat" and a.dominant_phase == "decode"
    first = a.levers[0]
    assert (first.lever, first.measured) == ("lower_precision", True)
    assert INT4[1] in first.title and "3.00× measured" in first.evidence
    assert "240 W against 360 W (33% less, n=40)" in first.evidence
    assert math.isclose(first.expected_effect.seconds, (399 / 50) * (1 - 1 / 3), rel_tol=0.02)
    # J/token at decode load: 360 / 50 against 240 / 150
    assert math.isclose(first.expected_effect.joules_per_token, 360 / 50 - 240 / 150, rel_tol=0.02)
    assert "outside what phasewatch measures" in first.caveat
    # fp8 is not served: its typical range stays, marked expected
    fp8 = [lv for lv in a.levers if lv.title == "serve fp8"]
    assert len(fp8) == 1 and fp8[0].measured is False and "1.80–2.00×" in fp8[0].evidence
    # int4 has nothing lower to go to
    assert not [lv for lv in got["int4"].levers if lv.lever == "lower_precision"]


def test_energy_shares_from_power_samples_by_state():
    m = Metrics()
    traffic(m, BF16, 40, 150, 400, 0.05, 8.0)
    sample = m.gpu_power_sample_watts
    for state, watts, n in (("idle", 50.0, 10), ("prefill", 400.0, 10), ("decode", 300.0, 20)):
        for _ in range(n):
            sample.labels("gpu", BF16[1], "bf16", "0", state).observe(watts)
    e = rows(m)["bf16"].energy
    total = 500 + 4000 + 6000
    assert e["samples"] == 40
    assert math.isclose(e["shares"]["idle"], 500 / total)
    assert math.isclose(e["shares"]["decode"], 6000 / total)


def test_unstreamed_traffic_is_batch():
    m = Metrics()
    traffic(m, BF16, 40, 3000, 600, 1.0, 10.0, stream=False)
    a = rows(m)["bf16"]
    assert a.workload == "batch" and "0 of 40 answers streamed" in a.workload_evidence
    assert a.shares is None and a.levers == []


def test_an_fp8_kv_cache_where_the_engine_preempted_for_want_of_cache():
    m = Metrics()
    traffic(m, BF16, 40, 150, 400, 0.05, 8.0)
    m.model_kv_bytes_per_token.labels(*BF16, "bf16").set(131072)
    lab = dict(zip(("upstream", "model", "precision"), BF16, strict=True))
    a = rows(m, [Sample("phasewatch_engine_preemptions_total", lab, 12.0)])["bf16"]
    kv = [lv for lv in a.levers if lv.lever == "fp8_kv_cache"]
    assert len(kv) == 1 and "preempted 12 requests" in kv[0].evidence
    assert kv[0].measured is False and kv[0].expected_effect.seconds is None
    assert a.levers[-1].lever == "fp8_kv_cache"  # no seconds to its name: last
    # no preemption, no shortage: no lever
    assert not [lv for lv in rows(m)["bf16"].levers if lv.lever == "fp8_kv_cache"]


def test_batching_from_decode_rates_by_batch():
    m = Metrics()
    traffic(m, BF16, 40, 150, 400, 0.05, 8.0, watts=300.0)
    for batch, n, rate in (("1", 30, 50.0), ("5-8", 12, 45.0)):
        m.decode_batch_requests_total.labels(*BF16, batch).inc(n)
        m.decode_batch_seconds_total.labels(*BF16, batch).inc(n * 8.0)
        m.decode_batch_tokens_total.labels(*BF16, batch).inc(n * 8.0 * rate)
    a = rows(m)["bf16"]
    assert a.batching["typical"] == "1"  # most decode time was spent one stream at a time
    assert "below the 8–16 range" in a.batching["fp8_energy_line"]
    (lever,) = [lv for lv in a.levers if lv.lever == "batching"]
    assert lever.measured and lever.requests == 42
    # 45 tok/s per stream at about 6.5 streams against 50 alone
    assert "about 5.8× the generated tokens per second" in lever.expected_effect.summary
    assert math.isclose(
        lever.expected_effect.joules_per_token, 300 / 50 - 300 / (45 * 6.5), rel_tol=1e-6
    )
    fp8 = next(lv for lv in a.levers if lv.title == "serve fp8")
    assert "below the 8–16 range" in fp8.evidence
    # a band with a handful of requests is no evidence
    m.decode_batch_requests_total.labels(*BF16, "9-16").inc(3)
    m.decode_batch_seconds_total.labels(*BF16, "9-16").inc(24)
    m.decode_batch_tokens_total.labels(*BF16, "9-16").inc(24 * 44 * 3)
    (lever,) = [lv for lv in rows(m)["bf16"].levers if lv.lever == "batching"]
    assert "batch 5-8" in lever.evidence


def test_energy_shares_from_per_phase_energy_counters_where_exported():
    m = Metrics()
    traffic(m, BF16, 40, 150, 400, 0.05, 8.0)
    lab = dict(zip(("upstream", "model", "precision"), BF16, strict=True))
    extra = [
        Sample("phasewatch_request_phase_energy_joules_total", {**lab, "phase": "prefill"}, 100.0),
        Sample("phasewatch_request_phase_energy_joules_total", {**lab, "phase": "decode"}, 800.0),
        Sample("phasewatch_gpu_idle_energy_joules_total", {**lab, "gpu": "0"}, 100.0),
        Sample("phasewatch_gpu_energy_joules_total", {**lab, "gpu": "0"}, 1000.0),
    ]
    a = rows(m, extra)["bf16"]
    e = a.energy
    assert e["shares"] == {"idle": 0.1, "prefill": 0.1, "decode": 0.8}
    # the text names the counters, not "0 power samples"
    assert e["basis"] == "energy counters" and e["requests"] == 40
    text = advice_markdown([a])
    assert "10% / 10% / 80% (from the GPUs' energy counters, over 40 requests)" in text
    assert "power samples" not in text
    assert math.isclose(e["joules_per_token_decode"], 800 / (40 * 400))


def test_mixed_prompts_are_carried_by_the_long_ones():
    # 30 short chats and 10 long documents: the median prompt is short, the prefill time
    # is the documents'
    m = Metrics()
    traffic(m, BF16, 30, 200, 24, 0.01, 0.5)
    traffic(m, BF16, 10, 12000, 24, 8.0, 0.5)
    a = rows(m)["bf16"]
    assert a.prompt_tokens_median < 2048 and a.dominant_phase == "prefill"
    first = a.levers[0]
    assert first.lever == "shorter_prompts"
    mean_prefill = (30 * 0.01 + 10 * 8.0) / 40
    assert math.isclose(first.expected_effect.seconds, mean_prefill / 2, rel_tol=1e-6)
    assert "halving the prompts saves 1.00 s of TTFT" in first.expected_effect.summary
    assert "halving the median prompt saves 0.0" in first.expected_effect.summary


def test_a_sibling_with_too_few_requests_is_named_not_denied():
    # fp8 with 35 streamed requests, int4 of the same family beside it with 15
    m = Metrics()
    traffic(m, FP8, 35, 150, 400, 0.05, 399 / 90)
    traffic(m, INT4, 15, 150, 400, 0.04, 399 / 150)
    a = rows(m)["fp8"]
    (lever,) = [lv for lv in a.levers if lv.lever == "lower_precision"]
    assert lever.measured is False and lever.title == f"serve int4: {INT4[1]}"
    assert f"{INT4[1]} (int4) is served here, but with 15 streamed requests" in lever.evidence
    assert f"needs {MIN_REQUESTS}" in lever.evidence
    assert "no int4 of this family is served here" not in lever.evidence


def test_enough_requests_but_too_few_streamed_says_so():
    m = Metrics()
    traffic(m, BF16, 35, 3000, 200, 1.0, 4.0, stream=False)
    traffic(m, BF16, 5, 3000, 200, 1.0, 4.0)
    a = rows(m)["bf16"]
    assert a.enough and a.levers == []
    assert "no lever has evidence on this traffic" in a.note
    assert f"prefill rates measured on 5 streamed requests ({MIN_REQUESTS} needed)" in a.note
    assert f"decode rates measured on 5 streamed requests ({MIN_REQUESTS} needed)" in a.note


def _batches(m, key, bands):
    for batch, n, rate in bands:
        m.decode_batch_requests_total.labels(*key, batch).inc(n)
        m.decode_batch_seconds_total.labels(*key, batch).inc(n * 2.0)
        m.decode_batch_tokens_total.labels(*key, batch).inc(n * 2.0 * rate)


def test_memory_bound_decode_gets_more_concurrent_streams_first():
    # int4 (nothing lower to serve), decode ~99 % of wall time, mostly 3-4 streams at once;
    # one stream keeps 45.9 of its 48.9 tok/s from batch 1 to 3-4: memory-bound
    m = Metrics()
    traffic(m, INT4, 40, 150, 400, 0.02, 399 / 46, watts=250.0)
    _batches(m, INT4, (("1", 10, 48.9), ("3-4", 30, 45.9)))
    a = rows(m)["int4"]
    assert a.dominant_phase == "decode" and a.shares["decode"] > 0.99
    first = a.levers[0]
    assert (first.lever, first.phase, first.measured) == ("batching", "decode", True)
    assert "more concurrent streams per GPU" in first.title
    assert "48.9 tok/s at batch 1 (10 requests)" in first.evidence
    assert "45.9 tok/s at batch 3-4 (30 requests): 6% slower per stream" in first.evidence
    assert "decode is memory-bound here" in first.expected_effect.summary
    assert f"{45.9 * 3.5 / 48.9:.1f}× the tokens per second in all" in (
        first.expected_effect.summary
    )
    # a compute-bound decode (one stream halves its rate) gets no such lever, and says why
    m = Metrics()
    traffic(m, INT4, 40, 150, 400, 0.02, 399 / 46)
    _batches(m, INT4, (("1", 10, 48.9), ("3-4", 30, 24.0)))
    a = rows(m)["int4"]
    assert not [lv for lv in a.levers if lv.lever == "batching"]
    assert "decode, the dominant phase" in a.note or "no lever has evidence" in a.note
    assert "batch 1: 10, batch 3-4: 30" in a.note


def test_one_batch_band_is_no_evidence_and_the_note_says_so():
    m = Metrics()
    traffic(m, INT4, 40, 150, 400, 0.02, 399 / 46)
    _batches(m, INT4, (("1", 2, 48.9), ("3-4", 38, 45.9)))
    a = rows(m)["int4"]
    assert a.levers == [] or all(lv.phase != "decode" for lv in a.levers)
    assert f"two batch bands of {MIN_BATCH_REQUESTS} requests each" in a.note
    assert "batch 1: 2, batch 3-4: 38" in a.note
