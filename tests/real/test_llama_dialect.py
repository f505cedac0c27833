"""The llama-server dialect against the real llama-server: detection, precision, its own
`timings` as source="engine" figures, prefix-cache hits kept out of the prefill rate, and
plain streams byte-exact with the proxy's default settings (it never injects usage there,
because that would move `timings` off the finish event)."""

from __future__ import annotations

import json

import pytest

from .engines import LLAMA_ALIAS
from .test_llama_server import assert_same, chat
from .wire import capture, payloads, prom, total, wait_for

pytestmark = pytest.mark.real_engine


def _after_one_more(proxy_url: str, before: dict) -> dict:
    def grown():
        s = prom(proxy_url)
        d = total(s, "phasewatch_requests_total") - total(before, "phasewatch_requests_total")
        return s if d >= 1 else None

    after, _ = wait_for(grown, 10, what="request recorded")
    return after


def test_detected_as_llama_server_with_q4_k_m(llama_proxy):
    s = prom(llama_proxy.url)
    assert total(s, "phasewatch_upstream_up", upstream="llama", engine="llamacpp") == 1
    info = {dict(k[1]).get("quant"): dict(k[1]) for k in s if k[0] == "phasewatch_model_info"}
    assert "Q4_K_M" in info, info
    assert info["Q4_K_M"]["precision"] == "int4"


def test_plain_stream_is_byte_exact_with_default_settings(llama, llama_proxy):
    body = chat()
    direct = capture(llama.url, "/v1/chat/completions", body)
    via = capture(llama_proxy.url, "/v1/chat/completions", body)
    assert_same(direct, via, "plain chat stream, default proxy")
    events = payloads(via.body)
    assert "timings" in events[-2] and b'"usage"' not in via.body


@pytest.mark.parametrize("stream", [True, False])
def test_engine_figures_equal_the_timings(llama_proxy, stream):
    before = prom(llama_proxy.url)
    cap = capture(
        llama_proxy.url, "/v1/chat/completions", chat(max_tokens=24, stream=stream, ignore_eos=True)
    )
    timings = payloads(cap.body)[-2]["timings"] if stream else json.loads(cap.body)["timings"]
    after = _after_one_more(llama_proxy.url, before)

    def grew(name, **labels):
        lbl = dict(upstream="llama", source="engine", **labels)
        return total(after, name, **lbl) - total(before, name, **lbl)

    assert grew("phasewatch_prefill_seconds_sum") == pytest.approx(
        timings["prompt_ms"] / 1000, rel=1e-9
    )
    assert grew("phasewatch_decode_seconds_sum") == pytest.approx(
        timings["predicted_ms"] / 1000, rel=1e-9
    )
    assert grew("phasewatch_decode_tokens_per_second_sum") == pytest.approx(
        timings["predicted_per_second"], rel=1e-9
    )
    assert grew("phasewatch_prefill_tokens_per_second_sum") == pytest.approx(
        timings["prompt_n"] / (timings["prompt_ms"] / 1000), rel=1e-9
    )
    if stream:  # the proxy's own decode rate beside the engine's
        proxy_rate = total(
            after, "phasewatch_decode_tokens_per_second_sum", upstream="llama", source="proxy"
        ) - total(
            before, "phasewatch_decode_tokens_per_second_sum", upstream="llama", source="proxy"
        )
        print(
            f"\nllama decode: engine {timings['predicted_per_second']:.2f} tok/s, "
            f"proxy {proxy_rate:.2f} tok/s"
        )
        assert proxy_rate == pytest.approx(timings["predicted_per_second"], rel=0.10)
        waited = total(
            after, "phasewatch_queue_seconds_count", upstream="llama", where="upstream"
        ) - total(before, "phasewatch_queue_seconds_count", upstream="llama", where="upstream")
        assert waited == 1  # (t_first - t_sent) - prompt_ms, observed once
    else:  # a non-streamed answer has no proxy-side phase figures
        assert total(
            after, "phasewatch_decode_tokens_per_second_count", upstream="llama", source="proxy"
        ) == total(
            before, "phasewatch_decode_tokens_per_second_count", upstream="llama", source="proxy"
        )


def test_prompt_cache_hits_are_not_prefill(llama_proxy):
    """Same long prompt twice with the prefix cache on: the second request's cached tokens
    count as `cached`, not as prefill work, and its prefill rate uses prompt_n only."""
    prompt = "Here is a long shared system preamble about colours. " * 12 + "Name one colour."
    body = {
        "model": LLAMA_ALIAS,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 4,
        "temperature": 0,
        "seed": 42,
        "cache_prompt": True,
        "stream": True,
    }
    capture(llama_proxy.url, "/v1/chat/completions", body)
    before = prom(llama_proxy.url)
    cap = capture(llama_proxy.url, "/v1/chat/completions", body)
    timings = payloads(cap.body)[-2]["timings"]
    after = _after_one_more(llama_proxy.url, before)
    assert timings["cache_n"] > 0, timings

    def grew(name, **labels):
        return total(after, name, upstream="llama", **labels) - total(
            before, name, upstream="llama", **labels
        )

    assert grew("phasewatch_tokens_total", phase="prefill") == timings["prompt_n"]
    assert grew("phasewatch_tokens_total", phase="cached") == timings["cache_n"]
    assert grew("phasewatch_prefill_tokens_per_second_sum", source="engine") == pytest.approx(
        timings["prompt_n"] / (timings["prompt_ms"] / 1000), rel=1e-9
    )
