"""phasewatch's own API under /phasewatch/ (FastAPI), its probes, and /metrics, through a
real proxy on loopback: OpenAPI, liveness vs readiness, keys, the exposition format."""

from __future__ import annotations

import base64
import gzip

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

from ...support.servers import free_port, start_proxy


@pytest.fixture(scope="module")
def keyed(sim):
    proxy = start_proxy(f"sim={sim.url}", args=["--api-key", "k1"])
    yield proxy
    proxy.stop()


def test_openapi_lists_the_own_routes_and_docs_render(proxy):
    spec = httpx.get(proxy.url + "/phasewatch/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/phasewatch/health",
        "/phasewatch/ready",
        "/phasewatch/api/summary",
        "/phasewatch/debug",
        "/phasewatch/",
    } <= paths
    # the summary's response model is typed down to its rows
    schema = spec["paths"]["/phasewatch/api/summary"]["get"]["responses"]["200"]["content"]
    ref = schema["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    row_ref = spec["components"]["schemas"][ref]["properties"]["rows"]["items"]["$ref"]
    row = spec["components"]["schemas"][row_ref.rsplit("/", 1)[1]]
    assert {"decode_tok_s", "prefill_ms_per_token", "recent"} <= set(row["properties"])
    docs = httpx.get(proxy.url + "/phasewatch/docs")
    assert docs.status_code == 200 and "/phasewatch/openapi.json" in docs.text
    # relayed paths are not in the own API
    assert not any(p.startswith("/v1") for p in paths)


def test_summary_and_debug_answer_in_their_models(proxy):
    summary = httpx.get(proxy.url + "/phasewatch/api/summary").json()
    assert summary["upstreams"][0]["name"] == "sim" and summary["upstreams"][0]["engine"] == "vllm"
    debug = httpx.get(proxy.url + "/phasewatch/debug").json()
    assert set(debug) == {"tasks", "busy", "draining"}


def test_readiness_follows_the_upstream_liveness_does_not(sim):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(f"dead={dead}")
    try:
        ready = httpx.get(proxy.url + "/phasewatch/ready")
        assert ready.status_code == 503
        assert ready.json()["upstreams"] == [
            {
                "name": "dead",
                "url": dead,
                "engine": "unknown",
                "up": False,
                "models": 0,
                "stalled": 0,
            }
        ]
        assert ready.json()["degraded"] is False and ready.json()["reasons"] == []
        assert httpx.get(proxy.url + "/phasewatch/health").status_code == 200
        # said in the log at start, with the upstream's name
        assert any(
            "upstream dead" in line and "not answering" in line for line in proxy.log().splitlines()
        )
    finally:
        proxy.stop()


def test_own_routes_need_a_key_when_keys_are_set(keyed):
    url = keyed.url
    for path in ("/phasewatch/api/summary", "/phasewatch/debug", "/phasewatch/", "/metrics"):
        r = httpx.get(url + path)
        assert r.status_code == 401, path
        assert httpx.get(url + path, headers={"authorization": "Bearer k1"}).status_code == 200
        assert httpx.get(url + path, headers={"x-api-key": "k1"}).status_code == 200
        assert httpx.get(url + path, headers={"x-api-key": "wrong"}).status_code == 401
    # browsers: the page asks for Basic credentials, the key as the password
    page = httpx.get(url + "/phasewatch/", headers={"accept": "text/html"})
    assert page.headers["www-authenticate"].startswith("Basic ")
    basic = base64.b64encode(b"anyone:k1").decode()
    assert (
        httpx.get(
            url + "/", headers={"accept": "text/html", "authorization": f"Basic {basic}"}
        ).status_code
        == 200
    )
    # probes stay open for orchestrators
    assert httpx.get(url + "/phasewatch/health").status_code == 200
    assert httpx.get(url + "/phasewatch/ready").status_code == 200


def test_metrics_public_opens_metrics_only(sim):
    proxy = start_proxy(f"sim={sim.url}", args=["--api-key", "k1", "--metrics-public"])
    try:
        assert httpx.get(proxy.url + "/metrics").status_code == 200
        assert httpx.get(proxy.url + "/phasewatch/api/summary").status_code == 401
    finally:
        proxy.stop()


def test_exposition_negotiates_openmetrics_and_gzip_with_process_metrics(proxy):
    plain = httpx.get(proxy.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = plain.text
    assert "_created" not in text  # no _created series
    assert "process_resident_memory_bytes" in text and "python_info" in text
    assert "python_gc_objects_collected_total" in text  # the GC collector too
    om = httpx.get(
        proxy.url + "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    names = {f.name for f in om_parse(om.text)}
    assert "phasewatch_ttft_seconds" in names and om.text.endswith("# EOF\n")
    raw = httpx.get(proxy.url + "/metrics", headers={"accept-encoding": "gzip"})
    assert raw.headers.get("content-encoding") == "gzip"
    with httpx.stream("GET", proxy.url + "/metrics", headers={"accept-encoding": "gzip"}) as r:
        body = b"".join(r.iter_raw())
    assert gzip.decompress(body).decode().startswith("# HELP")


def test_the_private_bucket_api_observe_counts_relies_on_is_there():
    """observe_counts adds to histogram buckets through prometheus-client's private
    attributes (pyproject.toml caps the version): this fails first if they move."""
    from prometheus_client import CollectorRegistry, Histogram

    from proxy.measure.metrics import observe_counts

    h = Histogram("x_seconds", "x", ["a"], buckets=(0.1, 1.0), registry=CollectorRegistry())
    child = h.labels("1")
    observe_counts(child, [2, 1, 0], 0.35)
    samples = {(s.name, s.labels.get("le")): s.value for s in h.collect()[0].samples}
    assert samples[("x_seconds_bucket", "0.1")] == 2
    assert samples[("x_seconds_bucket", "1.0")] == 3
    assert samples[("x_seconds_count", None)] == 3 and samples[("x_seconds_sum", None)] == 0.35
