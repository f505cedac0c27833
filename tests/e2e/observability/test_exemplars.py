"""Exemplars: the TTFT, decode-rate and request-duration histograms name one request per
bucket (its request id, and its trace id when it was traced), in the OpenMetrics
exposition /metrics negotiates; a real Prometheus with exemplar storage stores them, and
every dashboard query that asks for exemplars gets them back.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from proxy.measure.metrics import Metrics
from proxy.measure.recorder import exemplar

from ...support.servers import ROOT, free_port, start_proxy, start_sim, wait_for

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
EXEMPLAR_METRICS = {
    "phasewatch_ttft_seconds",
    "phasewatch_decode_tokens_per_second",
    "phasewatch_request_seconds",
}


def test_exemplar_labels_fit_openmetrics_limit():
    m = Metrics(CollectorRegistry())
    child = m.ttft_seconds.labels("u", "m", "bf16", "0-2k")
    for rid in ("r" * 128, "é" * 128, "short"):
        for trace in (None, "ab" * 16):
            labels = exemplar(rid, trace)
            assert sum(len(k) + len(v) for k, v in labels.items()) <= 128
            assert labels["request_id"] and (rid.startswith(labels["request_id"]) or rid[0] == "é")
            assert labels.get("trace_id") == trace
            child.observe(0.2, labels)  # prometheus-client refuses anything longer
    # a client's id is free text: what could confuse a parser becomes "_"
    assert exemplar('a"b\\c } # {x="y"} 1', None) == {"request_id": "a_b_c______x=_y___1"}
    assert exemplar("req-1.2:3/4+5=6@7_8", None) == {"request_id": "req-1.2:3/4+5=6@7_8"}
    text = openmetrics_latest(m.registry).decode()
    (fam,) = [
        f for f in text_string_to_metric_families(text) if f.name == "phasewatch_ttft_seconds"
    ]
    (got,) = [s.exemplar for s in fam.samples if s.exemplar is not None]
    assert got.labels == {"request_id": "short", "trace_id": "ab" * 16} and got.value == 0.2
    # the classic text format has no exemplars and stays as it was
    assert "trace_id" not in generate_latest(m.registry).decode()


class _Prometheus:
    """A real Prometheus with exemplar storage, scraping one target every second."""

    def __init__(self, target: str, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                {"job_name": "phasewatch", "static_configs": [{"targets": [target]}]}
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = tmp / "prometheus.log"
        exe = shutil.which("prometheus")
        assert exe, "prometheus is not installed: apt-get install -y prometheus"
        self.proc = subprocess.Popen(
            [
                exe,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--enable-feature=exemplar-storage",
                "--log.level=warn",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )

    def exemplars(self, query: str, start: float, end: float) -> list[dict]:
        r = httpx.get(
            self.url + "/api/v1/query_exemplars",
            params={"query": query, "start": start, "end": end},
            timeout=30,
        )
        body = r.json()
        assert body.get("status") == "success", f"{query}\n-> {body}"
        return body["data"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _exemplar_targets() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "grafana" / "dashboards").glob("*.json")):
        dash = json.loads(path.read_text())
        panels = [p for top in dash["panels"] for p in [top, *top.get("panels", [])]]
        for panel in panels:
            for t in panel.get("targets", []):
                if t.get("exemplar"):
                    out.append((panel["title"], t["expr"]))
    return out


def _substitute(expr: str) -> str:
    for key, value in {
        "upstream": ".*",
        "model": ".*",
        "precision": ".*",
        "source": "proxy",
        "__rate_interval": "1m",
    }.items():
        expr = expr.replace("$" + key, value)
    assert "$" not in expr, expr
    return expr


def test_dashboards_ask_for_exemplars_on_ttft_decode_and_request_duration():
    targets = _exemplar_targets()
    named = {m for _, expr in targets for m in EXEMPLAR_METRICS if m + "_bucket" in expr}
    assert named == EXEMPLAR_METRICS, targets


def test_prometheus_stores_the_exemplars_the_dashboards_show():
    tmp = Path(tempfile.mkdtemp(prefix="pw-exemplars-"))
    sim = start_sim("vllm", speed=4.0)
    proxy = start_proxy(f"sim={sim.url}")
    prom = None
    try:
        start = time.time() - 5
        ids = []
        for i in range(4):
            rid = f"exemplar-{i}"
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi " * (20 + 200 * i)}],
                "max_tokens": 30,
                "ignore_eos": True,
                "stream": True,
            }
            r = httpx.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                headers={"x-request-id": rid},
                timeout=60,
            )
            assert r.status_code == 200
            ids.append(rid)
        # what Prometheus will scrape: OpenMetrics with exemplars, parsed by the reference parser
        text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
        seen = {
            fam.name
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.exemplar is not None and s.exemplar.labels["request_id"] in ids
        }
        assert seen == EXEMPLAR_METRICS

        prom = _Prometheus(proxy.url.removeprefix("http://"), tmp)
        targets = _exemplar_targets()
        deadline = time.monotonic() + 60
        missing = targets
        while missing:
            assert prom.proc.poll() is None, prom.log.read_text()
            assert time.monotonic() < deadline, (
                f"no exemplars for {missing}: {prom.log.read_text()}"
            )
            time.sleep(0.5)
            try:
                got = {
                    (title, expr): prom.exemplars(_substitute(expr), start, time.time() + 5)
                    for title, expr in targets
                }
            except httpx.HTTPError:
                continue  # not up yet
            missing = [k for k, v in got.items() if not v]
        for (title, _), series in got.items():
            labels = [e["labels"] for s in series for e in s["exemplars"]]
            assert labels and all(lab["request_id"] in ids for lab in labels), title
    finally:
        if prom is not None:
            prom.stop()
        proxy.stop()
        sim.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("accept", [OPENMETRICS, "text/plain"])
def test_metrics_endpoint_negotiates_the_format(proxy, accept):
    httpx.post(
        proxy.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
        timeout=30,
    )
    r = httpx.get(proxy.url + "/metrics", headers={"accept": accept})
    has = "# {request_id=" in r.text
    assert has == (accept == OPENMETRICS)


def test_a_hostile_request_id_cannot_break_the_exposition(proxy):
    hostile = 'x"} # 1 2\\'
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
        },
        headers={"x-request-id": hostile},
        timeout=30,
    )
    assert r.status_code == 200
    text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
    labels = [
        s.exemplar.labels["request_id"]
        for fam in text_string_to_metric_families(text)  # the reference parser reads it all
        for s in fam.samples
        if s.exemplar is not None
    ]
    assert "x_____1_2_" in labels
    wait_for(  # exact in the log
        lambda: any(line["request_id"] == hostile for line in proxy.request_lines()),
        what="the hostile id in the log",
    )
