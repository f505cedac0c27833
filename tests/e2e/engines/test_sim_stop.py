"""The simulator stops cleanly: a client that hangs up while queued, and a server stopped
with requests in flight, leave no traceback in its log."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import pytest

from proxy.sim.engine import ModelEngine
from proxy.sim.physics import DEFAULT_MODELS, RTX_4090

from ...support.servers import start_sim


async def test_a_cancelled_waiter_released_in_the_same_tick_is_not_an_error():
    """A queued request is cancelled, and before it handles that, a release drops its
    (cancelled) turn from the queue: the cancellation must still end cleanly."""
    me = ModelEngine(DEFAULT_MODELS[0], RTX_4090, 0, 1, 1.0, 0.0, random.Random(0))
    await me.admit(1, 10)
    b = asyncio.create_task(me.admit(2, 10))
    c = asyncio.create_task(me.admit(3, 10))
    await asyncio.sleep(0)
    assert me.waiting == 2
    b.cancel()
    me.release(1)  # pops b's cancelled turn and wakes c, before b runs its handler
    with pytest.raises(asyncio.CancelledError):
        await b
    await asyncio.wait_for(c, 5)
    assert 3 in me.running and me.waiting == 0


@pytest.mark.parametrize("engine", ["vllm", "ollama", "llamacpp", "sglang", "trtllm"])
async def test_stopped_mid_request_without_tracebacks(engine):
    sim = start_sim(engine, speed=1.0, max_num_seqs=1)
    model = {
        "vllm": "meta-llama/Llama-3.1-8B-Instruct",
        "ollama": "llama3.1:8b-instruct-q4_K_M",
        "llamacpp": "qwen2.5-7b-instruct",
        "sglang": "meta-llama/Llama-3.1-8B-Instruct",
        "trtllm": "meta-llama/Llama-3.1-8B-Instruct",
    }[engine]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello " * 40}],
        "max_tokens": 400,
        "stream": True,
    }
    started = asyncio.Event()

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            async for _ in resp.aiter_raw():
                started.set()

    try:
        async with httpx.AsyncClient(base_url=sim.url, timeout=30) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(5)]
            await asyncio.wait_for(started.wait(), 20)  # one runs, the others queue
            tasks[2].cancel()  # a queued client hangs up
            tasks[0].cancel()  # and the running one
            await asyncio.sleep(0.2)
            sim.proc.send_signal(signal.SIGTERM)  # stopped with requests in flight
            deadline = time.monotonic() + 10
            while "Shutting down" not in sim.log() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        sim.proc.wait(timeout=20)
    finally:
        sim.stop()
    log = sim.log()
    assert "Finished server process" in log
    assert "Traceback" not in log and "level=error" not in log, log[-3000:]
