"""`phasewatch bench` pieces against scripted servers (httpx.MockTransport): what counts
as the first token, exact prompts through a llama-server-style /tokenize, and the
calibrated estimate where the engine has no tokenizer endpoint."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from proxy.tools.bench import Client, Prompts, _ints


def _client(handler) -> Client:
    c = Client("http://engine/v1", None, 30.0, ignore_eos=True)
    c.http = httpx.AsyncClient(base_url=c.base, transport=httpx.MockTransport(handler))
    return c


def _sse(*events) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


async def test_first_token_is_the_first_event_with_content():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=_sse(
                {
                    "choices": [{"delta": {"role": "assistant", "content": ""}}]
                },  # role only: not a token
                {"choices": [{"delta": {"reasoning_content": "hm"}}]},  # reasoning is output
                {"choices": [{"delta": {"content": "a"}}]},
                {"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}},
                b"[DONE]",
            ),
        )

    client = _client(handler)
    shot = await client.shot("m", "hello", 3)
    await client.aclose()
    assert (
        seen["body"]["stream_options"] == {"include_usage": True}
        and seen["body"]["ignore_eos"] is True
    )
    assert shot.content_events == 3 and shot.prompt_tokens == 7 and shot.completion_tokens == 3
    assert shot.ttft_s is not None and shot.decode_tok_s is not None and shot.decode_tok_s > 0


async def test_error_status_is_reported():
    client = _client(lambda r: httpx.Response(404, json={"error": {"message": "no such model"}}))
    with pytest.raises(Exception, match=r"HTTP 404.*no such model"):
        await client.shot("m", "hello", 3)
    await client.aclose()


def _llamacpp(request: httpx.Request) -> httpx.Response:
    """llama-server: /tokenize {content} -> {tokens}, /apply-template adds the template."""
    body = json.loads(request.content)
    if request.url.path == "/tokenize":
        if "content" not in body:
            return httpx.Response(500, json={"error": "content missing"})
        # a tokenizer that splits long words in two
        pieces = sum(2 if len(w) > 6 else 1 for w in body["content"].split())
        return httpx.Response(
            200, json={"tokens": list(range(pieces + (1 if body.get("add_special") else 0)))}
        )
    if request.url.path == "/apply-template":
        text = body["messages"][0]["content"]
        return httpx.Response(200, json={"prompt": f"<start> user: {text} <end> assistant:"})
    return httpx.Response(404, text="not found")


async def test_exact_prompts_through_llama_server_tokenize():
    client = _client(_llamacpp)
    prompts = Prompts(client, "m", seed=1)
    await prompts.setup()
    assert prompts.kind == "llamacpp"
    for target in (50, 777, 4096):
        text, counted = await prompts.make(target)
        assert counted == target
        # what the engine would count: template + BOS + the words
        pieces = (
            sum(2 if len(w) > 6 else 1 for w in f"<start> user: {text} <end> assistant:".split())
            + 1
        )
        assert pieces == target
    assert prompts.method.startswith("exact")
    await client.aclose()


async def test_calibrated_estimate_without_a_tokenizer():
    """No /tokenize: two requests' usage calibrate tokens per word and the template."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(404, text="404 page not found")
        words = len(json.loads(request.content)["messages"][0]["content"].split())
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": "x"}}],
                "usage": {"prompt_tokens": round(words * 1.3) + 11, "completion_tokens": 1},
            },
        )

    client = _client(handler)
    prompts = Prompts(client, "m", seed=1)
    await prompts.setup()
    assert prompts.kind == "calibrated"
    assert prompts.per_word == pytest.approx(1.3, rel=0.01) and prompts.overhead == pytest.approx(
        11, abs=2
    )
    text, expected = await prompts.make(4096)
    assert abs(round(len(text.split()) * 1.3) + 11 - 4096) <= 4
    assert re.match(r"estimate: calibrated on usage \(1\.3\d\d tokens/word", prompts.method)
    await client.aclose()


def test_prompts_never_share_a_prefix():
    prompts = Prompts(None, "m", seed=0)  # type: ignore[arg-type]
    firsts = {tuple(prompts.words(200).split()[:16]) for _ in range(20)}
    assert len(firsts) == 20  # a prefix cache cannot serve a repetition


def test_int_lists():
    assert _ints("4096,8192, 16384") == [4096, 8192, 16384] and _ints("") == []
    with pytest.raises(ValueError):
        _ints("4k")
    with pytest.raises(ValueError):
        _ints("0")


def test_cli_errors_are_one_clear_line():
    import subprocess
    import sys

    from ...support.servers import ROOT, free_port

    dead = f"http://127.0.0.1:{free_port()}"
    for args, rc, text in (
        (["bench", "--url", dead, "--quiet"], 1, f"cannot reach {dead}"),
        (["bench", "--repeat", "0"], 2, "--repeat must be at least 1"),
        (["bench", "--prompt-tokens", "4k"], 2, "comma-separated integers"),
        (["report", "--from", dead], 1, f"cannot read {dead}"),
    ):
        res = subprocess.run(
            [sys.executable, "-m", "proxy", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == rc and text in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr
