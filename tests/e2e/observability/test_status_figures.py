"""The status page's derived figures and sensor line, through the page in Chromium and
the summary API, against a quiet `phasewatch demo` (simulated GPUs and sensors): each
speed-up, power saved and J/token shows the requests it rests on (and its prompt band),
is "—" with why below the minimum count, and the sensor line survives the page's polls."""

from __future__ import annotations

import httpx

from proxy.measure.summary import MIN_FIGURE_REQUESTS

from ...support.browser import Browser
from ...support.servers import metric_samples, sample, wait_for
from ..tools.advice_scenarios import BF16, FP8, INT4, drive
from ..tools.test_bench_power_sensor import demo

N = MIN_FIGURE_REQUESTS + 2


def test_figures_carry_their_count_and_band_and_the_sensor_line_stays():
    proc, url = demo("0")
    try:
        # ~3K-token prompts (the ~4K band), answers long enough for the sensor; fp8 short
        jobs = [(m, 3000, 120) for m in (BF16, INT4) for _ in range(N)]
        drive(url, jobs + [(FP8, 3000, 120)] * 3, 4)
        wait_for(  # every decode phase settled: observed or unresolved
            lambda: (
                (s := metric_samples(url))
                and sample(s, "phasewatch_gpu_power_watts_count", phase="decode")
                + sample(s, "phasewatch_gpu_power_unresolved_total", phase="decode")
                >= 2 * N + 3
            ),
            what="the decode phases settled",
        )
        summary = httpx.get(url + "/phasewatch/api/summary", timeout=10).json()
        b = Browser()
        try:
            page = b.page(url + "/phasewatch/", 1400, 900)
            # the first render and two polls after it (the line used to empty at the poll)
            page.wait("+document.body.dataset.rendered >= 3")
            shown = page.eval(
                """({sensor: document.getElementById('power-sensor').textContent,
                     rows: Object.fromEntries([...document.querySelectorAll('#table tbody tr[data-model]')]
                       .map(tr => [tr.dataset.precision, Object.fromEntries(
                         [...tr.querySelectorAll('td[data-col]')].map(td =>
                           [td.dataset.col, {text: td.textContent, title: td.title}]))])),
                     notes: document.getElementById('notes').textContent})"""
            )
            page.close()
        finally:
            b.close()
    finally:
        proc.terminate()
        proc.wait(30)
    # the API declares the sensor's lines, and the page shows them after its polls
    assert summary["power_sensor"] and summary["power_sensor"][0].startswith("GPU ")
    # (the refresh period is re-measured between reads: the lines' shape, not their digits)
    assert shown["sensor"].startswith(summary["power_sensor"][0].split(",")[0])
    assert len(shown["sensor"].split(". ")) == len(summary["power_sensor"])
    assert "Phases too short for the sensor" in shown["sensor"]
    rows = {r["precision"]: r for r in summary["rows"]}
    int4, fp8 = rows["int4"], rows["fp8"]
    # int4 against bf16: N requests each, the prefill speed-up in the ~4K band
    assert int4["counts"]["decode_speedup"] == N and int4["decode_speedup"] > 1
    assert int4["prefill_speedup_band"] == "2k-6k" and int4["counts"]["prefill_speedup"] == N
    cells = shown["rows"]["int4"]
    assert cells["speedup"]["text"] == f"{int4['decode_speedup']:.2f}×n={N}"
    assert cells["prefillx"]["text"] == f"{int4['prefill_speedup']:.2f}×n={N} ~4K"
    if int4["power_saving"] is not None:  # the sensor resolved enough decode windows
        n = int4["counts"]["power_saving"]
        assert n >= MIN_FIGURE_REQUESTS and f"n={n:.0f} batch " in cells["saving"]["text"]
    else:
        assert "needed" in cells["saving"]["title"]
    # fp8 rests on 3 requests: no speed-up, the count and why instead
    assert fp8["decode_speedup"] is None and fp8["counts"]["decode_speedup"] == 3
    assert shown["rows"]["fp8"]["speedup"]["text"] == "—n=3"
    assert (
        shown["rows"]["fp8"]["speedup"]["title"]
        == f"decode measured on 3 requests; {MIN_FIGURE_REQUESTS} needed"
    )
    # the footnote says what power saved compares
    assert (
        "whatever batch each ran" in shown["notes"]
        and "one stream at decode load" not in (shown["notes"])
    )
