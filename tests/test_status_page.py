"""The live status page: its routes (browsers only at `/`, the engine's own `GET /` still
passes through for API clients), its JSON, and the page rendered in a real headless
Chromium after `phasewatch demo` traffic, with a screenshot kept as a test artifact."""

from __future__ import annotations

import html.parser
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from .servers import _spawn, free_port

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


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed for the status page test: apt-get install -y chromium")


def _browse(url: str, *extra: str) -> subprocess.CompletedProcess:
    profile = tempfile.mkdtemp(prefix="pw-chromium-")
    try:
        return subprocess.run(
            [
                _chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=4000",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


class _Rows(html.parser.HTMLParser):
    """Table rows of the rendered page: {precision: [cell texts]}."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, list[str]] = {}
        self.cards: list[str] = []
        self._row: str | None = None
        self._cell: list[str] | None = None
        self.canvases = 0
        self.rendered = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body" and a.get("data-rendered"):
            self.rendered = int(a["data-rendered"])
        if tag == "tr" and "data-precision" in a:
            self._row = a["data-precision"]
            self.rows[self._row] = []
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "canvas":
            self.canvases += 1

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None and self._row is not None:
            self.rows[self._row].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def demo():
    port = free_port()
    proc, log = _spawn(
        ["demo", "--port", str(port), "--speed", "10", "--rate", "4", "--seed", "3"],
        port,
        "/phasewatch/health",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # wait for decode rates and a long-prompt band for every precision
        deadline = time.monotonic() + 45
        while True:
            rows = httpx.get(url + "/phasewatch/api/summary", timeout=10).json()["rows"]
            ready = [
                r for r in rows if r["decode_tok_s"] and set(r["ttft_s"]) - {"0-2k", "unknown"}
            ]
            if len(ready) >= 3 or time.monotonic() > deadline:
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


def test_status_page_renders_live_numbers_in_chromium(demo):
    summary = httpx.get(demo + "/phasewatch/api/summary", timeout=10).json()
    api = {r["precision"]: r for r in summary["rows"]}
    assert {"bf16", "fp8", "int4"} <= {p for p, r in api.items() if r["decode_tok_s"]}

    res = _browse(demo + "/", "--dump-dom")
    assert res.returncode == 0, res.stderr[-2000:]
    dom = _Rows()
    dom.feed(res.stdout)
    assert dom.rendered >= 1 and dom.canvases == 3
    assert {"bf16", "fp8", "int4"} <= set(dom.rows)
    decode = {}
    for prec in ("bf16", "fp8", "int4"):
        cells = dom.rows[prec]
        assert cells[1].startswith(prec)
        assert float(cells[2]) >= api[prec]["requests"] * 0.5  # requests (still growing)
        decode[prec] = float(cells[4])  # decode tok/s, rendered by the page's JS
        assert decode[prec] == pytest.approx(api[prec]["decode_tok_s"], rel=0.25), prec
    # the physics shows on the page: int4 decodes ~3x faster than bf16
    assert 2.2 < decode["int4"] / decode["bf16"] < 3.8
    if summary["power_sampled"]:  # the demo maps each simulated GPU to its model
        watts = {p: float(dom.rows[p][8]) for p in ("bf16", "int4")}  # decode W
        assert watts["int4"] < watts["bf16"] <= 450  # lower precision draws less
        assert 10 < float(dom.rows["bf16"][9]) < 100  # idle W: tens of watts
        assert float(dom.rows["int4"][10]) < float(dom.rows["bf16"][10])  # J/token
        assert "sim gpu 0" in res.stdout  # the power chart's legend
    else:  # no power source: the power columns say so rather than showing zeros
        assert dom.rows["bf16"][8:11] == ["n/a"] * 3
    assert "× /" in dom.rows["int4"][12]  # speed-up decode / prefill

    # a screenshot, kept as an artifact (and where PHASEWATCH_ARTIFACTS says, for CI)
    out_dir = Path(os.environ.get("PHASEWATCH_ARTIFACTS") or tempfile.mkdtemp(prefix="pw-status-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "status-page.png"
    res = _browse(demo + "/phasewatch/", f"--screenshot={png}", "--window-size=1600,1000")
    assert res.returncode == 0 and png.exists(), res.stderr[-2000:]
    data = png.read_bytes()
    assert (
        data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    )  # a page with charts, not a blank
    print(f"status page screenshot: {png}")
