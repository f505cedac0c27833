"""A gentle traffic generator: a mix of chat requests a small team might send, so the
proxy's metrics and dashboards fill up (including the ~4K, ~8K and ~16K prompt bands)."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx

log = logging.getLogger("phasewatch.traffic")

_FILLER = (
    "the quick brown fox jumps over the lazy dog while the GPU reads every weight "
    "once per decode step and prefill runs the whole prompt in one pass "
).split()


def prompt_of(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of text (the simulator counts whitespace pieces)."""
    return " ".join(rng.choice(_FILLER) for _ in range(max(1, tokens)))


async def one_request(client: httpx.AsyncClient, model: str, rng: random.Random) -> None:
    roll = rng.random()
    prompt_tokens = (
        rng.randint(20, 400)
        if roll < 0.75
        else rng.choice((4096, 8192, 16384)) + rng.randint(-300, 300)
    )
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt_of(prompt_tokens, rng)}],
        "max_tokens": rng.choice((1, 32, 64, 128, 256))
        if prompt_tokens > 2000
        else rng.randint(16, 256),
        "stream": rng.random() < 0.85,
    }
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for _ in resp.aiter_raw():
                    pass
        else:
            await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        log.warning("traffic request failed: %s", exc)


async def run_traffic(base_url: str, rate: float, stop: asyncio.Event, seed: int = 1) -> None:
    """Poisson arrivals at `rate` per second over the models the proxy lists."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        models: list[str] = []
        while not models and not stop.is_set():
            try:
                data = json.loads((await client.get("/v1/models")).content)
                models = [m["id"] for m in data.get("data", [])]
            except (httpx.HTTPError, ValueError, KeyError):
                await asyncio.sleep(0.5)
        tasks: set[asyncio.Task] = set()
        while not stop.is_set():
            task = asyncio.create_task(one_request(client, rng.choice(models), rng))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            try:
                await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(rate))
            except TimeoutError:
                pass
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
