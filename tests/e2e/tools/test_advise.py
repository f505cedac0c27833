"""`phasewatch advise` against the simulator's truth: traffic shapes whose right answer is
known (RAG-shaped: prefill; chat-shaped: decode; a saturated engine: queue; three
precisions of one family: the measured quantisation lever), through a real proxy. Each
names the right dominant phase and first lever with numbers that agree with the truth;
too little traffic gets no recommendation; the API, the status page and `report` show
the same rows."""

from __future__ import annotations

import statistics

import httpx
import pytest

from ...support.browser import Browser
from ...support.servers import metric_samples, sample, start_proxy, start_sim, wait_for
from .advice_scenarios import BF16, FP8, INT4, advise_json, cli, drive, truth_of

SPEED = 10.0  # the simulated RTX 4090 runs 10x fast
N = 36  # a few dozen requests of one shape: enough to speak


def _scenario(jobs, concurrency: int, max_num_seqs: int = 16, scrape: bool = False):
    sim = start_sim(
        "vllm", speed=SPEED, deterministic=False, jitter=0.02, max_num_seqs=max_num_seqs
    )
    # the engine's own series only where a scenario needs them (a scrape between two reads
    # would change the figures the API, report and advise are compared on)
    proxy = start_proxy(f"sim={sim.url}", args=["--engine-scrape", "0.5" if scrape else "0"])
    try:
        drive(proxy.url, jobs, concurrency)
        proxy.request_lines(len(jobs))
        if scrape:  # the engine's own queue histogram, scraped after the last request
            wait_for(
                lambda: (
                    sample(metric_samples(proxy.url), "phasewatch_engine_queue_seconds_count")
                    >= len(jobs)
                ),
                what="the engine's queue histogram",
            )
        got = {(a["model"]): a for a in advise_json(proxy.url)}
        return sim, proxy, got, sim.truth(len(jobs))
    except BaseException:
        proxy.stop()
        sim.stop()
        raise


@pytest.fixture(scope="module")
def rag():
    sim, proxy, advice, truth = _scenario([(BF16, 12000, 24)] * N, 4)
    yield {"proxy": proxy, "advice": advice[BF16], "truth": truth_of(truth, BF16)}
    proxy.stop()
    sim.stop()


def _close(a: dict, b: dict, abs_tol: float) -> None:
    for k in b:
        assert a[k] == pytest.approx(b[k], abs=abs_tol), (k, a, b)


def test_rag_shaped_traffic_is_prefill_bound_and_says_shorten_the_prompt(rag):
    a, t = rag["advice"], rag["truth"]
    assert a["enough"] and a["requests"] == N
    assert a["workload"] == "document analysis"
    assert a["dominant_phase"] == "prefill"
    _close(a["shares"], t["shares"], 0.06)
    first = a["levers"][0]
    assert (first["lever"], first["phase"], first["measured"]) == (
        "shorter_prompts",
        "prefill",
        True,
    )
    assert first["requests"] == N
    # halving the median prompt saves half its prefill at the measured rate
    assert a["formula"]["prefill_tok_s"] == pytest.approx(t["prefill_tok_s"], rel=0.15)
    assert first["expected_effect"]["seconds"] == pytest.approx(
        12000 / 2 / t["prefill_tok_s"], rel=0.15
    )
    assert first["expected_effect"]["ttft"] is True
    assert "halving the median prompt saves" in first["expected_effect"]["summary"]
    assert f"over {N} requests" in first["evidence"]
    # the formula: prompt / prefill rate + output / decode rate is what was measured
    assert 0.85 < a["formula"]["ratio"] < 1.15
    assert a["seconds"]["prefill"] == pytest.approx(t["mean_s"]["prefill"], rel=0.15)
    # no GPU sampled: energy says so rather than a number
    assert a["energy"]["shares"] is None and "unavailable" in a["energy"]["note"]
    levers = [lv["lever"] for lv in a["levers"]]
    assert "prefix_caching" in levers
    # every lower-precision lever here is a typical range, marked so, with the quality caveat
    for lv in a["levers"]:
        if lv["lever"] == "lower_precision":
            assert lv["measured"] is False and "outside what phasewatch measures" in lv["caveat"]


def test_the_api_and_report_show_the_same_rows(rag):
    url = rag["proxy"].url
    api = {a["model"]: a for a in httpx.get(url + "/phasewatch/api/advice", timeout=10).json()}
    cli_rows = {a["model"]: a for a in advise_json(url)}
    assert set(api) == set(cli_rows) == {BF16}

    def gist(a):
        return (
            a["dominant_phase"],
            a["workload"],
            {k: round(v, 6) for k, v in a["shares"].items()},
            [
                (
                    lv["lever"],
                    lv["phase"],
                    lv["measured"],
                    round(lv["expected_effect"]["seconds"] or 0, 6),
                )
                for lv in a["levers"]
            ],
        )

    assert gist(api[BF16]) == gist(cli_rows[BF16])
    summary = httpx.get(url + "/phasewatch/api/summary", timeout=10).json()
    assert [gist(a) for a in summary["advice"]] == [gist(api[BF16])]
    # report: the same section advise prints
    report = cli("report", "--from", url)
    advise_md = cli("advise", "--from", url)
    assert advise_md.startswith("## Advice")
    assert report[report.index("## Advice") :].strip() == advise_md.strip()


@pytest.fixture(scope="module")
def chat():
    sim, proxy, advice, truth = _scenario([(BF16, 150, 300)] * N, 6)
    proxy.stop()
    sim.stop()
    return {"advice": advice[BF16], "truth": truth_of(truth, BF16)}


def test_chat_shaped_traffic_is_decode_bound_and_says_quantise(chat):
    a, t = chat["advice"], chat["truth"]
    assert a["workload"] == "interactive chat"
    assert a["dominant_phase"] == "decode"
    _close(a["shares"], t["shares"], 0.06)
    first = a["levers"][0]
    assert (first["lever"], first["phase"]) == ("lower_precision", "decode")
    # no other precision served here: the typical range, marked expected
    assert first["measured"] is False and "int4" in first["title"]
    assert "2.50–3.50×" in first["evidence"] and f"over {N} requests" in first["evidence"]
    assert a["formula"]["decode_tok_s"] == pytest.approx(t["decode_tok_s"], rel=0.15)
    # the lower end of the range applied to the measured decode time
    assert first["expected_effect"]["seconds"] == pytest.approx(
        t["mean_s"]["decode"] * (1 - 1 / 2.5), rel=0.15
    )
    assert all(lv["phase"] != "prefill" for lv in a["levers"])  # prefill is ~1 %: no lever


@pytest.fixture(scope="module")
def saturated():
    # two sequences at a time on the engine, twelve clients: most of the wait is queue
    sim, proxy, advice, truth = _scenario([(BF16, 150, 100)] * N, 12, max_num_seqs=2, scrape=True)
    proxy.stop()
    sim.stop()
    return {"advice": advice[BF16], "truth": truth_of(truth, BF16)}


def test_a_saturated_engine_is_queue_bound_and_says_add_capacity(saturated):
    a, t = saturated["advice"], saturated["truth"]
    assert t["shares"]["queue"] > 0.5  # the scenario is what it claims
    assert a["dominant_phase"] == "queue"
    _close(a["shares"], t["shares"], 0.08)
    first = a["levers"][0]
    assert (first["lever"], first["phase"], first["measured"]) == ("queueing", "queue", True)
    assert first["expected_effect"]["seconds"] == pytest.approx(t["mean_s"]["queue"], rel=0.2)
    assert "the engine's own queue time" in first["evidence"]


@pytest.fixture(scope="module")
def three():
    jobs = [(m, 150, 200) for m in (BF16, FP8, INT4) for _ in range(32)]
    sim, proxy, advice, truth = _scenario(jobs, 6)
    yield {
        "proxy": proxy,
        "advice": advice,
        "truth": {m: truth_of(truth, m) for m in (BF16, FP8, INT4)},
    }
    proxy.stop()
    sim.stop()


def test_three_precisions_cite_the_measured_speed_up(three):
    a, t = three["advice"][BF16], three["truth"]
    assert a["dominant_phase"] == "decode"
    first, second = a["levers"][:2]
    assert (first["lever"], first["measured"]) == ("lower_precision", True)
    assert INT4 in first["title"] and FP8 in second["title"]
    truth_x = t[INT4]["decode_tok_s"] / t[BF16]["decode_tok_s"]
    cited = float(first["evidence"].split("× measured")[0].rsplit(" ", 1)[1])
    assert cited == pytest.approx(truth_x, rel=0.15)
    fp8_x = float(second["evidence"].split("× measured")[0].rsplit(" ", 1)[1])
    assert fp8_x == pytest.approx(t[FP8]["decode_tok_s"] / t[BF16]["decode_tok_s"], rel=0.15)
    assert first["expected_effect"]["seconds"] > second["expected_effect"]["seconds"] > 0
    assert "outside what phasewatch measures" in first["caveat"]
    # the lowest precision has nothing lower to go to: no quantisation lever
    assert not [lv for lv in three["advice"][INT4]["levers"] if lv["lever"] == "lower_precision"]


def test_the_status_page_panel_shows_the_same_rows(three):
    url = three["proxy"].url
    api = httpx.get(url + "/phasewatch/api/advice", timeout=10).json()
    browser = Browser()
    try:
        page = browser.page(url + "/phasewatch/", 1200, 900)
        page.wait("+document.body.dataset.rendered >= 1")
        shown = page.eval(
            """[...document.querySelectorAll('#advice .adv')].map(d => ({
                 model: d.dataset.model, dominant: d.dataset.dominant,
                 levers: [...d.querySelectorAll('li[data-lever]')].map(li => li.dataset.lever),
                 text: d.textContent}))"""
        )
        page.close()
    finally:
        browser.close()
    assert [(s["model"], s["dominant"], s["levers"]) for s in shown] == [
        (a["model"], a["dominant_phase"], [lv["lever"] for lv in a["levers"]]) for a in api
    ]
    bf16 = next(s for s in shown if s["model"] == BF16)
    assert "× measured" in bf16["text"] and "interactive chat" in bf16["text"]


def test_too_little_traffic_gives_no_recommendation():
    sim, proxy, advice, _ = _scenario([(BF16, 12000, 24)] * 5, 5)
    try:
        a = advice[BF16]
        assert a["enough"] is False and a["levers"] == [] and a["dominant_phase"] is None
        assert "only 5 measured requests" in a["note"]
        md = cli("advise", "--from", proxy.url)
        assert "none is given yet" in md and "1. **" not in md
    finally:
        proxy.stop()
        sim.stop()


def test_batching_cites_the_measured_rates_by_batch():
    # 30 requests one at a time, then 32 eight at a time: the same GPU, two batches
    sim = start_sim("vllm", speed=SPEED, deterministic=False, jitter=0.02)
    proxy = start_proxy(f"sim={sim.url}", args=["--engine-scrape", "0"])
    try:
        drive(proxy.url, [(BF16, 150, 150)] * 30, 1)
        drive(proxy.url, [(BF16, 150, 150)] * 32, 8)
        proxy.request_lines(62)
        (a,) = advise_json(proxy.url)
        truth = sim.truth(62)
    finally:
        proxy.stop()
        sim.stop()
    alone = statistics.median(t["decode_tokens_per_second"] for t in truth[:30])
    bands = a["batching"]["bands"]
    # the first of the eight may be admitted alone (batch 1 too); the rest join larger ones
    assert a["batching"]["typical"] == "1" and 30 <= bands["1"]["requests"] < 36
    assert bands["1"]["tok_s_per_stream"] == pytest.approx(alone, rel=0.15)
    assert sum(b["requests"] for b in bands.values()) == 62
    (lever,) = [lv for lv in a["levers"] if lv["lever"] == "batching"]
    assert (
        lever["measured"]
        and "× the generated tokens per second" in lever["expected_effect"]["summary"]
    )
    assert "one stream decodes" in lever["evidence"]
    assert f"({bands['1']['requests']:.0f} requests)" in lever["evidence"]
    assert "below the 8–16 range" in lever["evidence"]


def test_memory_bound_decode_says_more_concurrent_streams_first():
    # int4 chat (nothing lower to serve): ten requests one at a time, then 40 four at a
    # time; decode is nearly all the wall time and one stream barely slows with the batch
    sim = start_sim("vllm", speed=SPEED, deterministic=False, jitter=0.02)
    proxy = start_proxy(f"sim={sim.url}", args=["--engine-scrape", "0"])
    try:
        drive(proxy.url, [(INT4, 100, 300)] * 10, 1)
        drive(proxy.url, [(INT4, 100, 300)] * 40, 4)
        proxy.request_lines(50)
        (a,) = advise_json(proxy.url)
        md = cli("advise", "--from", proxy.url)
        truth = sim.truth(50)
    finally:
        proxy.stop()
        sim.stop()
    assert a["dominant_phase"] == "decode" and a["shares"]["decode"] > 0.9
    first = a["levers"][0]
    assert (first["lever"], first["phase"], first["measured"]) == ("batching", "decode", True)
    assert "more concurrent streams per GPU" in first["title"]
    assert "decode is memory-bound here" in first["expected_effect"]["summary"]
    bands = a["batching"]["bands"]
    assert a["batching"]["typical"] == "3-4"
    # the per-stream rates it cites are the simulator's, alone and four at a time
    alone = statistics.median(t["decode_tokens_per_second"] for t in truth[:10])
    assert bands["1"]["tok_s_per_stream"] == pytest.approx(alone, rel=0.15)
    assert f"{bands['1']['tok_s_per_stream']:.1f} tok/s at batch 1" in first["evidence"]
    assert f"{bands['3-4']['tok_s_per_stream']:.1f} tok/s at batch 3-4" in first["evidence"]
    assert "1. **more concurrent streams per GPU" in md


def test_a_short_sibling_is_named_and_unstreamed_traffic_says_why_it_is_silent():
    # fp8 with 35 streamed requests, its family's int4 with 15; bf16 with 40 requests of
    # which 5 streamed
    jobs = [(FP8, 150, 100)] * 35 + [(INT4, 150, 100)] * 15
    jobs += [(BF16, 150, 100, False)] * 35 + [(BF16, 150, 100)] * 5
    sim, proxy, advice, _ = _scenario(jobs, 6)
    try:
        md = cli("advise", "--from", proxy.url)
    finally:
        proxy.stop()
        sim.stop()
    (lever,) = [lv for lv in advice[FP8]["levers"] if lv["lever"] == "lower_precision"]
    assert lever["measured"] is False and lever["title"] == f"serve int4: {INT4}"
    assert f"{INT4} (int4) is served here, but with 15 streamed requests" in lever["evidence"]
    assert "no int4 of this family is served here" not in md
    bf16 = advice[BF16]
    assert bf16["enough"] and bf16["levers"] == []
    assert "decode rates measured on 5 streamed requests (30 needed)" in bf16["note"]
    assert "decode rates measured on 5 streamed requests" in md
