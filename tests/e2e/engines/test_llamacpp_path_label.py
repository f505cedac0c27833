"""A llama-server started without ``-a`` lists its model by the GGUF file's full local
path: phasewatch labels it by the file name (requests naming the path or anything else
count under it), and `report`'s KV-cache headroom honours the server's slots (``-np``)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from ...support.servers import ROOT, metric_samples, sample, start_proxy, start_sim, wait_for

FILE = "qwen2.5-7b-instruct-q4_k_m.gguf"


def test_a_path_shaped_model_id_is_labelled_by_its_file_name_and_slots_bound_the_fit():
    sim = start_sim("llamacpp", max_num_seqs=2, extra=["--no-alias"])
    proxy = start_proxy(f"lc={sim.url}", args=["--engine-scrape", "0.5"])
    try:
        listed = httpx.get(sim.url + "/v1/models").json()["data"][0]["id"]
        assert listed.startswith("/") and listed.endswith("/" + FILE)  # what the engine says
        # the model list still reaches clients unchanged
        assert httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"] == listed
        for model in (listed, FILE, "whatever"):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "word " * 40}],
                "max_tokens": 16,
                "stream": True,
            }
            with httpx.stream(
                "POST", proxy.url + "/v1/chat/completions", json=body, timeout=60
            ) as r:
                assert r.status_code == 200
                r.read()
        proxy.request_lines(3)
        wait_for(
            lambda: sample(metric_samples(proxy.url), "phasewatch_engine_slots", model=FILE) == 2,
            what="the engine's slots",
        )
        samples = metric_samples(proxy.url)
        models = {dict(k[1]).get("model") for k in samples if k[0] == "phasewatch_requests_total"}
        assert models == {FILE}, models  # no local path in any label
        assert sample(samples, "phasewatch_requests_total", model=FILE) == 3
        assert not any(listed in str(k) for k in samples)
        info = [dict(k[1]) for k in samples if k[0] == "phasewatch_model_info"]
        assert [i["precision"] for i in info if i["model"] == FILE] == ["int4"]
        res = subprocess.run(
            [sys.executable, "-m", "proxy", "report", "--from", proxy.url, "--format", "json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        (row,) = json.loads(res.stdout)["rows"]
        assert row["model"] == FILE and row["engine_slots"] == 2
        # the cache (two slots of 4096 tokens) would hold far more of these short requests;
        # two run at once all the same
        assert row["kv_capacity_tokens"] == 2 * 4096
        assert row["kv_request_bytes"] * 10 < row["kv_capacity_tokens"] * row["kv_bytes_per_token"]
        assert row["kv_fit_requests"] == 2
        md = subprocess.run(
            [sys.executable, "-m", "proxy", "report", "--from", proxy.url],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        assert "| 2 (the engine's 2 slots) |" in md
    finally:
        proxy.stop()
        sim.stop()
