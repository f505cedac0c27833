"""The status page as a new operator meets it, in headless Chromium at 1400 and 800 px,
with one upstream down and 20 models (three simulated and busy, seventeen with long names
on a second engine): model names whole (wrapped, never cut), KV cache per token in KiB or
MiB, the power column saying it is a saving, the reason an upstream is down where the
summary gives one, chart ticks that never read alike, and no point cut off at an axis."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import httpx
import pytest

from ...support.browser import Browser
from ...support.fake_engine import FakeEngine
from ...support.servers import free_port, start_proxy, start_sim, wait_for

LONG = [
    f"acme-research/Very-Long-Model-Name-{i:02d}-Instruct-128k-GPTQ-Int4"
    if i % 2
    else f"org/model-{i:02d}-70B-Instruct-FP8-Dynamic"
    for i in range(17)
]
SIM_MODELS = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "RedHatAI/Llama-3.1-8B-Instruct-FP8",
    "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
)


@pytest.fixture(scope="module")
def busy_proxy():
    lister = FakeEngine(models=list(LONG), prompt_tokens=5).start()
    model_dir = tempfile.mkdtemp(prefix="pw-models-")
    sim = start_sim("vllm", speed=10.0, deterministic=False, extra=["--model-dir", model_dir])
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["--model-dir", model_dir, "--power-source", "dcgm", "--model-refresh", "2"]
    args += ["--power-dcgm-url", sim.url + "/metrics"]
    for i, m in enumerate(SIM_MODELS):
        args += ["--power-gpu", f"{i}={m}"]
    proxy = start_proxy(f"sim={sim.url}", f"big={lister.url}", f"dead={dead}", args=args)
    try:
        with httpx.Client(base_url=proxy.url, timeout=120) as c:
            for n in LONG[:3]:
                c.post(
                    "/v1/chat/completions",
                    json={"model": n, "messages": [{"role": "user", "content": "hi"}]},
                )
            for i in range(12):
                body = {
                    "model": SIM_MODELS[i % 3],
                    "messages": [{"role": "user", "content": "word " * (40 + 30 * i)}],
                    "max_tokens": 24,
                    "stream": True,
                }
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_raw():
                        pass

            def ready() -> bool:
                rows = c.get("/phasewatch/api/summary").json()["rows"]
                sim_rows = [r for r in rows if r["upstream"] == "sim"]
                return len(rows) >= 20 and all(r["kv_bytes_per_token"] for r in sim_rows)

            wait_for(ready, what="20 rows, the simulated models' KV-cache shapes read")
        yield proxy
    finally:
        proxy.stop()
        sim.stop()
        lister.stop()


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


CELLS_JS = """(() => [...document.querySelectorAll("tr[data-model]")].map(tr => {
  const m = tr.querySelector('td[data-col="model"]'), kv = tr.querySelector('td[data-col="kv"]');
  return {model: tr.dataset.model, upstream: tr.dataset.upstream, text: m.textContent,
          title: m.getAttribute("title"), cut: m.scrollWidth > m.clientWidth + 1,
          kv: kv.textContent};
}))()"""


@pytest.mark.parametrize("width", [1400, 800])
def test_the_page_with_20_models_and_an_upstream_down(busy_proxy, browser, width):
    page = browser.page(busy_proxy.url + "/phasewatch/", width, 900)
    try:
        page.wait("+document.body.dataset.rendered >= 1")
        cells = page.eval(CELLS_JS)
        assert len(cells) >= 20, cells
        for c in cells:  # whole names, in the cell and its title; nothing cut off
            assert c["model"] in c["text"] and c["model"] in c["title"], c
            assert not c["cut"], c
            assert "…" not in c["text"], c
        kv = {c["model"]: c["kv"] for c in cells if c["upstream"] == "sim"}
        for model in SIM_MODELS:
            assert re.fullmatch(r"\d+(\.\d)? (KiB|MiB)", kv[model]), kv
        heads = page.eval(
            '[...document.querySelectorAll("#table thead th")].map(t => t.textContent)'
        )
        assert "power saved" in heads and "per token" in heads and "B/tok" not in heads, heads
        layout = page.eval(
            "({page: document.documentElement.scrollWidth, viewport: innerWidth,"
            " box: document.getElementById('table').parentElement.clientWidth,"
            " scroll: document.getElementById('table').parentElement.scrollWidth})"
        )
        assert layout["page"] <= layout["viewport"], layout  # the page never scrolls sideways
        if width == 1400:
            assert layout["scroll"] <= layout["box"], layout  # the table fits at 1400 px
        # the down upstream's card, and its reason where the summary carries one
        state = page.eval("document.querySelector('[data-upstream=\"dead\"]').dataset.state")
        assert state == "down"
        # GPUs are mapped to the simulator's models: the other upstreams have none, and
        # say so rather than "0 W"
        cards = page.eval(
            """Object.fromEntries([...document.querySelectorAll(".card[data-upstream]")]
                 .map(c => [c.dataset.upstream, c.textContent]))"""
        )
        assert "no GPU mapped" in cards["big"] and "0 W" not in cards["big"], cards
        # one line per GPU, labelled by its index and model, not one unlabelled sum
        for i, model in enumerate(SIM_MODELS):
            assert re.search(rf"GPU {i} · {re.escape(model.split('/')[-1])}\d+ W", cards["sim"])
        assert "GPU power now" not in cards["sim"], cards
        reason = page.eval(
            """(async () => {
                 const d = await (await fetch(SUMMARY_URL)).json();
                 const u = d.upstreams.find(u => u.name === "dead");
                 if (!u.reason) u.reason = "connection refused";
                 render(d);
                 return [u.reason, document.querySelector('[data-upstream="dead"] .reason').textContent];
               })()"""
        )
        assert reason[0] == reason[1], reason
        out = Path(os.environ.get("PHASEWATCH_ARTIFACTS") or tempfile.mkdtemp(prefix="pw-status-"))
        out.mkdir(parents=True, exist_ok=True)
        page.screenshot(out / f"status-20-models-{width}.png")
    finally:
        page.close()


def test_chart_ticks_never_read_alike_and_no_point_is_cut_off(busy_proxy, browser):
    page = browser.page(busy_proxy.url + "/phasewatch/", 1400, 900)
    try:
        page.wait("+document.body.dataset.rendered >= 1")
        for window in (60, 120, 300, 600):
            ticks = page.eval(
                f"""(() => {{ const c = document.getElementById("ttft");
                   chart(c, [{{color: "#fff", label: "x", pts: [[-93, 0.5], [-10, 0.2]]}}],
                         {{window: {window}}}); return c.xticks; }})()"""
            )
            assert len(ticks) == len(set(ticks)) >= 3, (window, ticks)
        assert "90 s ago" in page.eval(
            """(() => { const c = document.getElementById("ttft");
               chart(c, [{color: "#fff", label: "x", pts: [[-93, 1]]}], {window: 120});
               return c.xticks; })()"""
        )
        # the lowest and highest points (and one past the window's start) lie inside what
        # is drawn, on a log axis and a linear one
        for pts, zero in (
            ("[[-50, 0.004], [-40, 0.2], [-30, 0.9], [-700, 0.05]]", "false"),
            ("[[-50, 3], [-40, 5], [-30, 4]]", "false"),
            ("[[-50, 0], [-40, 1500], [-30, 700]]", "true"),
        ):
            dots, clip = page.eval(
                f"""(() => {{ const c = document.getElementById("decode");
                   chart(c, [{{color: "#fff", label: "x", pts: {pts}}}], {{window: 60, zero: {zero}}});
                   return [c.dots, c.clip]; }})()"""
            )
            x0, y0, w, h = clip
            assert len(dots) == pts.count("[") - 1, dots
            for x, y, r in dots:
                assert x0 <= x - r and x + r <= x0 + w and y0 <= y - r and y + r <= y0 + h, (
                    pts,
                    (x, y, r),
                    clip,
                )
    finally:
        page.close()
