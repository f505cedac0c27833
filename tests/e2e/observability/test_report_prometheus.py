"""`phasewatch report --from` a real Prometheus server scraping the proxy gives the same
table as reading the proxy's /metrics directly (and a --window of recent traffic)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from ...support.servers import ROOT, free_port, start_proxy, start_sim

MODELS = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "RedHatAI/Llama-3.1-8B-Instruct-FP8",
    "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
)


@pytest.fixture(scope="module")
def proxy():
    """A proxy of this module's own: the session one carries other tests' traffic."""
    sim = start_sim("vllm", speed=4.0, deterministic=True)
    server = start_proxy(f"sim={sim.url}")
    yield server
    server.stop()
    sim.stop()


@pytest.fixture(scope="module")
def prometheus(proxy):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("a real Prometheus is needed for this test: apt-get install -y prometheus")
    work = Path(tempfile.mkdtemp(prefix="pw-prom-"))
    target = proxy.url.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: phasewatch\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (
                work / "prometheus.log"
            ).read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _report(source: str, *extra: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", source, "--format", "json", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _rows(rep: dict) -> dict:
    return {(r["upstream"], r["model"], r["precision"]): r for r in rep["rows"]}


def _report_text(source: str) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", source],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


#: Requests one round of _traffic sends (measured: every outcome counts).
PER_ROUND = len(MODELS) * 4 + 2


def _traffic(proxy_url: str, tag: str) -> None:
    with httpx.Client(base_url=proxy_url, timeout=60) as client:
        for i, model in enumerate(MODELS):
            for n, words in ((3, 60), (1, 3000)):
                for _ in range(n):
                    body = {
                        "model": model,
                        "stream": True,
                        "max_tokens": 40,
                        "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{tag}{i} " + "token " * words}],
                    }
                    assert client.post("/v1/chat/completions", json=body).status_code == 200
        # a model no upstream serves (labelled "other"): only errors, no figures
        body = {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 404
        # a client that hangs up in prefill (a long prompt; it leaves before a second token,
        # so the row's decode rates stay those of the complete answers)
        body = {
            "model": MODELS[0],
            "stream": True,
            "max_tokens": 2000,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{tag} abort " + "token " * 6000}],
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200


def _counted(proxy_url: str, want: float) -> None:
    """Wait until the proxy has recorded every request sent (an abort is recorded once the
    proxy sees the hang-up)."""
    deadline = time.monotonic() + 20
    while True:
        got = sum(r["requests"] for r in _report(proxy_url)["rows"])
        if got >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == want


def _scraped(proxy_url: str, prometheus: str) -> None:
    """Wait until Prometheus holds the proxy's current request count."""
    want = sum(r["requests"] for r in _report(proxy_url)["rows"])
    deadline = time.monotonic() + 20
    while True:
        data = httpx.get(
            prometheus + "/api/v1/query", params={"query": "sum(phasewatch_requests_total)"}
        ).json()
        got = float(data["data"]["result"][0]["value"][1]) if data["data"]["result"] else 0
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == want


def test_report_from_prometheus_equals_report_from_metrics(proxy, prometheus):
    _traffic(proxy.url, "a")
    _counted(proxy.url, PER_ROUND)
    _scraped(proxy.url, prometheus)
    # a second round once the series exist: increase() over a window sees it
    _traffic(proxy.url, "b")
    _counted(proxy.url, 2 * PER_ROUND)
    _scraped(proxy.url, prometheus)

    direct, via = _report(proxy.url), _report(prometheus)
    assert via["source"] == prometheus
    assert _rows(direct).keys() == _rows(via).keys() and len(_rows(via)) >= 3
    for key, d in _rows(direct).items():
        v = _rows(via)[key]
        for field in (
            "requests",
            "errors",
            "aborted",
            "decode_tok_s",
            "ttft_all_s",
            "share_prefill",
            "decode_speedup",
            "quant",
        ):
            assert v[field] == (
                pytest.approx(d[field]) if isinstance(d[field], float) else d[field]
            ), (key, field)
        assert v["prefill_ms_per_token"] == pytest.approx(d["prefill_ms_per_token"])
    assert "2k-6k" in _rows(via)[("sim", MODELS[0], "bf16")]["prefill_ms_per_token"]

    # the rendered tables are the same, line for line
    text, via_text = _report_text(proxy.url), _report_text(prometheus)
    table = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert table == [ln for ln in via_text.splitlines() if ln.startswith("|")]
    head = table[0].split(" | ")
    assert head[3:5] == ["requests", "errors / aborted"]
    main = text.split("\n\n")[0].splitlines()  # the first table; the band table follows
    rows = {ln.split(" | ")[1]: ln.split(" | ") for ln in main[2:]}
    assert set(rows) == set(MODELS)  # no all-dash row for "other", which only had errors
    assert rows[MODELS[0]][3:5] == [str(2 * 4 + 2), "0 / 2"]
    for t in (text, via_text):
        assert "Left out, nothing measured: sim / other (unknown): 2 requests, 2 errors" in t
        # each column says where its figure comes from
        assert "decode tok/s: source=proxy (phasewatch's own clock" in t
        assert "prefill ms/tok = 1000 / median prefill tok/s: source=proxy" in t
        assert "queue is included) for every row" in t

    recent = _rows(_report(prometheus, "--window", "5m"))
    assert recent.keys() == _rows(direct).keys()
    for key, d in _rows(direct).items():
        assert 0 < recent[key]["requests"] < d["requests"] * 1.5, key  # (extrapolated) recent part
        if d["decode_tok_s"] is None:  # the "other" row: errors only
            assert recent[key]["decode_tok_s"] is None, key
            continue
        assert recent[key]["decode_tok_s"] == pytest.approx(d["decode_tok_s"], rel=0.1), key


def _advise(source: str) -> dict:
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "advise", "--from", source, "--format", "json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return {(a["upstream"], a["model"], a["precision"]): a for a in json.loads(res.stdout)}


def test_advise_from_prometheus_equals_advise_from_metrics(proxy, prometheus):
    before = sum(r["requests"] for r in _report(proxy.url)["rows"])
    _traffic(proxy.url, "c")
    _counted(proxy.url, before + PER_ROUND)
    _scraped(proxy.url, prometheus)
    direct, via = _advise(proxy.url), _advise(prometheus)
    assert direct.keys() == via.keys() and len(direct) >= 3
    assert ("sim", "other", "unknown") not in direct  # errors only: nothing to advise on
    for key, d in direct.items():
        v = via[key]
        for field in ("requests", "enough", "workload", "dominant_phase", "note"):
            assert v[field] == d[field], (key, field)
        if d["shares"] is not None:
            assert v["shares"] == pytest.approx(d["shares"]), key
            assert v["seconds"] == pytest.approx(d["seconds"]), key
            assert v["formula"] == pytest.approx(d["formula"]), key
        assert [lv["lever"] for lv in v["levers"]] == [lv["lever"] for lv in d["levers"]]


def test_window_needs_prometheus(proxy):
    res = subprocess.run(
        [sys.executable, "-m", "proxy", "report", "--from", proxy.url, "--window", "5m"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1 and "--window needs a Prometheus server" in res.stderr
