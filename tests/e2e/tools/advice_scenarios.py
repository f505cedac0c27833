"""Traffic shapes whose right answer is known, driven through a real proxy in front of the
simulator, and the simulator's truth summarised the way the advice reads it."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys

import httpx

from ...support.servers import ROOT

BF16 = "meta-llama/Llama-3.1-8B-Instruct"
FP8 = "RedHatAI/Llama-3.1-8B-Instruct-FP8"
INT4 = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"


def prompt(tokens: int, salt: int) -> str:
    """`tokens` whitespace pieces (the simulator's tokens), different per request."""
    words = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta")
    return " ".join(f"{words[(i + salt) % len(words)]}{salt % 97}" for i in range(tokens))


async def _drive(url: str, jobs: list[tuple], concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(i: int, model: str, ptoks: int, out: int, stream: bool = True) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt(ptoks, i)}],
                "max_tokens": out,
                "ignore_eos": True,
                "stream": stream,
            }
            async with sem, client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200, resp.status_code
                async for _ in resp.aiter_raw():
                    pass

        await asyncio.gather(*(one(i, *job) for i, job in enumerate(jobs)))


def drive(url: str, jobs: list[tuple], concurrency: int) -> None:
    """Send (model, prompt tokens, output tokens[, stream]) chat requests, streamed unless
    the job says otherwise, `concurrency` at a time, each answered in full."""
    asyncio.run(_drive(url, jobs, concurrency))


def cli(*args: str, timeout: float = 120) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def advise_json(url: str) -> list[dict]:
    return json.loads(cli("advise", "--from", url, "--format", "json"))


def truth_of(records: list[dict], model: str) -> dict:
    """The simulator's truth for one model: mean seconds per phase, their shares, the
    median prefill and decode rates."""
    mine = [r for r in records if r["model"] == model and not r["aborted"]]
    queue = [r["queue_seconds"] for r in mine]
    prefill = [r["prefill_seconds"] for r in mine]
    decode = [r["decode_seconds"] for r in mine if "decode_seconds" in r]
    total = sum(queue) + sum(prefill) + sum(decode)
    return {
        "n": len(mine),
        "shares": {
            "queue": sum(queue) / total,
            "prefill": sum(prefill) / total,
            "decode": sum(decode) / total,
        },
        "prefill_tok_s": statistics.median(
            (r["prompt_tokens"] - r["cached_tokens"]) / r["prefill_seconds"] for r in mine
        ),
        "decode_tok_s": statistics.median(
            r["decode_tokens_per_second"] for r in mine if "decode_tokens_per_second" in r
        ),
        "mean_s": {
            "queue": statistics.mean(queue),
            "prefill": statistics.mean(prefill),
            "decode": statistics.mean(decode),
        },
    }
