"""The live status page: its routes (browsers only at `/`, the engine's own `GET /` still
passes through for API clients), its JSON, and the page rendered in a real headless
Chromium after `phasewatch demo` traffic, with a screenshot kept as a test artifact."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from proxy.measure.summary import MIN_FIGURE_REQUESTS

from ...support.browser import Browser
from ...support.servers import _spawn, free_port, start_proxy

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


def test_root_is_the_engines_for_api_clients_and_the_page_for_browsers(sim, proxy):
    direct = httpx.get(sim.url + "/")
    for accept in (None, "*/*", "application/json"):
        headers = {"accept": accept} if accept else {}
        via = httpx.get(proxy.url + "/", headers=headers)
        assert (via.status_code, via.content) == (direct.status_code, direct.content), accept
    page = httpx.get(proxy.url + "/", headers={"accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert (
        page.headers["vary"] == "Accept"
        and "default-src 'none'" in page.headers["content-security-policy"]
    )
    assert b"<title>phasewatch" in page.content
    assert (
        b'src="http' not in page.content and b'href="http' not in page.content
    )  # no external assets
    # other methods at / are the engine's, whatever they accept
    post = httpx.post(proxy.url + "/", headers={"accept": BROWSER_ACCEPT}, content=b"{}")
    assert post.content == httpx.post(sim.url + "/", content=b"{}").content
    for path in ("/phasewatch/", "/phasewatch"):
        r = httpx.get(proxy.url + path)
        assert r.status_code == 200 and b"<title>phasewatch" in r.content, path
    head = httpx.head(proxy.url + "/phasewatch/")
    assert (
        head.status_code == 200
        and head.content == b""
        and int(head.headers["content-length"]) > 1000
    )


def test_summary_json_counts_requests(proxy):
    body = {
        "model": "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
        "stream": True,
        "messages": [{"role": "user", "content": "word " * 40}],
        "max_tokens": 24,
    }
    for _ in range(3):
        assert (
            httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        )
    data = httpx.get(proxy.url + "/phasewatch/api/summary").json()
    assert data["upstreams"][0]["name"] == "sim" and data["upstreams"][0]["up"] is True
    rows = {r["precision"]: r for r in data["rows"]}
    assert set(rows) >= {"bf16", "fp8", "int4"}  # served models show before their first request
    int4 = rows["int4"]
    assert int4["requests"] >= 3 and int4["decode_tok_s"] > 0
    assert int4["recent"]["requests_per_min"] >= 3 and int4["recent"]["decode_tok_s"] > 0
    series = data["series"]
    mine = [p for p in data["points"] if series[p[1]]["precision"] == "int4"]
    assert len(mine) >= 3 and all(p[0] <= 0 and p[2] > 0 and p[3] > 0 for p in mine[-3:])
    assert data["power_sampled"] is False


# --- in a real browser ---------------------------------------------------------------------

#: The cells of every table row by column, as the page's script rendered them.
ROWS_JS = """(() => {
  const out = {};
  for (const tr of document.querySelectorAll("tr[data-precision]")) {
    const cells = {};
    for (const td of tr.querySelectorAll("td[data-col]")) {
      // a derived figure's count and band ("n=12 ~4K") sit in a span of their own
      const n = td.querySelector("span.n");
      cells[td.dataset.col] = (n ? td.textContent.slice(0, -n.textContent.length) : td.textContent).trim();
      if (n) cells[td.dataset.col + ":n"] = n.textContent;
      if (td.title) cells[td.dataset.col + ":title"] = td.title;
    }
    cells._class = Object.fromEntries([...tr.querySelectorAll("td[data-col]")].map(td => [td.dataset.col, td.className]));
    out[tr.dataset.upstream + "/" + tr.dataset.precision] = cells;
  }
  return out;
})()"""

#: Whether the table fits its box (no sideways scroll) and how many lines each header takes.
LAYOUT_JS = """(() => {
  const box = document.getElementById("table").parentElement;
  const lines = [...document.querySelectorAll("#table thead th")].map(th => {
    const cs = getComputedStyle(th);
    const inner = th.getBoundingClientRect().height - parseFloat(cs.paddingTop) - parseFloat(cs.paddingBottom);
    return Math.round(inner / parseFloat(cs.lineHeight));
  });
  return {scroll: box.scrollWidth, client: box.clientWidth, page: document.documentElement.scrollWidth,
          viewport: window.innerWidth, header_lines: Math.max(...lines), details: document.querySelectorAll("tr.detail").length};
})()"""


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def demo():
    port = free_port()
    # speed 2: a decode lasts long enough (int4's the shortest) for the simulated 100 ms
    # sensor behind a 100 ms exporter to resolve it; at 10 it is unresolved
    proc, log = _spawn(
        ["demo", "--port", str(port), "--speed", "2", "--rate", "4", "--seed", "3"],
        port,
        "/phasewatch/health",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # wait for decode rates and a long-prompt band for every precision, and a power history
        deadline = time.monotonic() + 60
        while True:
            data = httpx.get(url + "/phasewatch/api/summary", timeout=10).json()
            # every figure the page test reads: decode rate, a TTFT band, decode and idle
            # power (the power ledger settles after each request, behind the rates)
            ready = [
                r
                for r in data["rows"]
                if r["decode_tok_s"]
                and set(r["ttft_s"]) - {"0-2k", "unknown"}
                and r.get("decode_watts")
                and r.get("idle_watts")
                and r.get("decode_speedup")
                and r.get("prefill_speedup")
            ]
            if (len(ready) >= 3 and len(data["power_points"]) >= 8) or time.monotonic() > deadline:
                break
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.unlink(missing_ok=True)


def test_status_page_renders_live_numbers_in_chromium(demo, browser):
    summary = httpx.get(demo + "/phasewatch/api/summary", timeout=10).json()
    api = {r["precision"]: r for r in summary["rows"]}
    assert {"bf16", "fp8", "int4"} <= {p for p, r in api.items() if r["decode_tok_s"]}

    page = browser.page(demo + "/", 1400, 1000)
    try:
        page.wait("+document.body.dataset.rendered >= 1")
        rows = {k.split("/", 1)[1]: v for k, v in page.eval(ROWS_JS).items()}
        assert {"bf16", "fp8", "int4"} <= set(rows)
        decode = {}
        for prec in ("bf16", "fp8", "int4"):
            cells = rows[prec]
            assert cells["precision"].startswith(prec)
            assert float(cells["requests"]) >= api[prec]["requests"] * 0.5  # (still growing)
            assert cells["failed"] == "0 / 0"
            decode[prec] = float(cells["decode"])  # rendered by the page's script
            assert decode[prec] == pytest.approx(api[prec]["decode_tok_s"], rel=0.25), prec
        # the physics shows on the page: int4 decodes ~3x faster than bf16
        assert 2.2 < decode["int4"] / decode["bf16"] < 3.8
        assert summary["power_sampled"]  # the demo maps each simulated GPU to its model
        watts = {p: float(rows[p]["decodew"]) for p in ("bf16", "int4")}
        assert watts["int4"] < watts["bf16"] <= 450  # lower precision draws less
        assert 10 < float(rows["bf16"]["idlew"]) < 100  # idle: tens of watts
        # J/tok once the sensor resolved enough decode windows (int4's are the shortest),
        # else "—" with its count and why
        if api["int4"]["joules_per_token_at_decode"] is not None:
            assert float(rows["int4"]["jtok"]) < float(rows["bf16"]["jtok"])
        else:
            assert rows["int4"]["jtok"] == "—" and "needed" in rows["int4"]["jtok:title"]
        assert rows["int4"]["speedup"].endswith("×") and rows["int4"]["prefillx"].endswith("×")
        # the requests it rests on beside it (traffic goes on: at least the API's, read before)
        n = api["int4"]["counts"]["decode_speedup"]
        assert int(rows["int4"]["speedup:n"].removeprefix("n=")) >= n >= MIN_FIGURE_REQUESTS

        # at 1400 px the table fits: no sideways scroll, every header on one line
        layout = page.eval(LAYOUT_JS)
        assert layout["scroll"] <= layout["client"] and layout["page"] <= layout["viewport"], layout
        assert layout["header_lines"] == 1, layout
        # the details (in flight, time split, the last minute) open under the rows, not beside
        page.eval('document.getElementById("expand-all").click()')
        layout = page.eval(LAYOUT_JS)
        assert layout["details"] == len(rows) and layout["scroll"] <= layout["client"], layout
        detail = page.eval('document.querySelector("tr.detail").textContent')
        assert "last minute: decode tok/s" in detail and "in flight / queued" in detail

        # the power chart: one smoothed line per GPU, calmer than the step means it is made of
        drawn = page.eval(
            'document.getElementById("power").drawn.map(s => ({label: s.label, pts: s.pts}))'
        )
        assert {d["label"].split(" · ")[0] for d in drawn} == {
            "sim gpu 0",
            "sim gpu 1",
            "sim gpu 2",
        }
        assert "rolling mean" in page.eval(
            'document.getElementById("power").getAttribute("aria-label")'
        )
        raw: dict[str, list] = {}
        for _, watts_by_gpu in summary["power_points"]:
            for label, w in watts_by_gpu.items():
                raw.setdefault(label, []).append(w)

        def variation(values):
            return sum(abs(b - a) for a, b in itertools.pairwise(values))

        calmer = 0
        for d in drawn:
            ys = [p[1] for p in d["pts"]]
            # a mean stays within its samples (to float rounding: 3 × 49.8 / 3 is 49.79999…)
            eps = 1e-9 * max(abs(v) for v in raw[d["label"]])
            assert min(raw[d["label"]]) - eps <= min(ys) and max(ys) <= max(raw[d["label"]]) + eps
            calmer += variation(ys) < variation(raw[d["label"]])
        assert calmer >= 2, drawn  # a GPU whose power stayed flat has nothing to smooth

        # a screenshot at 1400 px, kept as an artifact (and where PHASEWATCH_ARTIFACTS says)
        page.eval('document.getElementById("expand-all").click()')  # details closed again
        out_dir = Path(
            os.environ.get("PHASEWATCH_ARTIFACTS") or tempfile.mkdtemp(prefix="pw-status-")
        )
        out_dir.mkdir(parents=True, exist_ok=True)
        png = out_dir / "status-page.png"
        page.screenshot(png)
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000  # charts, not a blank
        print(f"status page screenshot: {png}")
    finally:
        page.close()


def test_the_first_screen_at_800_px(demo, browser):
    """What a new user sees first: the speed-up and power columns on screen at 800 px, the
    prompt bands that hold the traffic, each GPU's power labelled, and the demo saying its
    figures are simulated."""
    page = browser.page(demo + "/", 800, 900)
    try:
        page.wait("+document.body.dataset.rendered >= 1")
        got = page.eval(
            """(() => {
              const box = document.getElementById("table").parentElement.getBoundingClientRect();
              const right = {};
              for (const c of ["speedup", "prefillx", "saving", "decodew", "jtok"])
                right[c] = document.querySelector('td[data-col="' + c + '"]').getBoundingClientRect().right;
              return {box: box.right, right,
                      heads: [...document.querySelectorAll("#table thead th[title]")].map(t => t.dataset.col || t.textContent),
                      cols: [...document.querySelectorAll("tr[data-precision] td[data-col]")].map(t => t.dataset.col),
                      simulated: !document.getElementById("simulated").hidden && document.getElementById("simulated").textContent,
                      title: document.title,
                      card: document.querySelector('.card[data-upstream="sim"]').textContent,
                      page: document.documentElement.scrollWidth};
            })()"""
        )
        assert got["page"] <= 800, got  # the page itself never scrolls sideways
        for col, right in got["right"].items():
            assert right <= got["box"] + 0.5, (col, got)  # on screen, no scrolling needed
        # the demo's chat-length prompts (<2K) have their own TTFT and prefill columns
        assert "prefill:0-2k" in got["cols"] and "ttft:0-2k" in got["cols"], got["cols"]
        assert got["simulated"] and "simulated" in got["simulated"] and "simulated" in got["title"]
        for i in range(3):
            assert re.search(rf"GPU {i} · Llama-3\.1-8B-Instruct[-\w]*\d+ W", got["card"]), got
    finally:
        page.close()


def test_a_dead_upstream_shows_failures_not_an_empty_page(browser):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(f"dead={dead}")
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(2):
            assert httpx.post(proxy.url + "/v1/chat/completions", json=body).status_code == 502
        page = browser.page(proxy.url + "/phasewatch/", 1400, 900)
        try:
            page.wait("+document.body.dataset.rendered >= 1")
            row = page.eval(ROWS_JS)["dead/unknown"]
            # a real proxy's page does not say simulated
            assert page.eval('document.getElementById("simulated").hidden') is True
            assert (row["requests"], row["failed"]) == ("2", "2 / 0")
            assert "bad" in row["_class"]["failed"]
            assert row["decode"] == "—"
            ttft = page.eval('document.getElementById("ttft").getAttribute("aria-label")')
            assert ttft == "no successful requests yet (2 of 2 failed or aborted)"
            card = page.eval(
                """(() => { const c = document.querySelector('[data-upstream="dead"]');
                   return {state: c.dataset.state, text: c.textContent}; })()"""
            )
            assert card["state"] == "down" and "engineunknown" in card["text"].replace(" ", "")
            assert "requests / failed2 / 2" in card["text"]
        finally:
            page.close()
    finally:
        proxy.stop()
