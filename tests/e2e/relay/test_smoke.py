import httpx


def test_stream_through_proxy_equals_direct(sim, proxy):
    body = {
        "model": "RedHatAI/Llama-3.1-8B-Instruct-FP8",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 12,
        "stream": True,
    }
    direct = httpx.post(sim.url + "/v1/chat/completions", json=body).content
    via = httpx.post(proxy.url + "/v1/chat/completions", json=body).content
    assert via == direct
    assert b"usage" not in via
