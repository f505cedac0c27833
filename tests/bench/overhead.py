"""What phasewatch costs: added TTFT and proxy CPU per streamed event, against direct.

Runs the simulator sped up so it streams with (almost) no inter-token delay, and
phasewatch in front of it, both as real processes on loopback. Interleaves direct and
proxied requests in one run so both see the same machine noise, then prints figures.
It asserts nothing: a benchmark, not a test.

    python tests/bench/overhead.py [--requests 200] [--tokens 64] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.servers import start_proxy, start_sim  # noqa: E402

MODEL = "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    ttft = None
    events = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if ttft is None and '"content":"' in line and '"content":""' not in line:
                    ttft = time.perf_counter() - t0
    return ttft or 0.0, events


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args) -> None:
    sim = start_sim("vllm", speed=args.speed, deterministic=False)
    proxy = start_proxy(f"sim={sim.url}", args=["--log-format", "none"])
    try:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=512)) as client:
            for url in (sim.url, proxy.url):  # warm both paths
                await one(client, url, 8)
            # (a) sequential: added TTFT
            direct, via = [], []
            for _ in range(args.requests):
                direct.append((await one(client, sim.url, args.tokens))[0])
                via.append((await one(client, proxy.url, args.tokens))[0])
            added = [v - d for v, d in zip(via, direct)]
            # (b) concurrent: proxy CPU per event
            cpu0 = cpu_seconds(proxy.proc.pid)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(client, proxy.url, args.tokens)
                                             for _ in range(args.concurrency * 4)))
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(proxy.proc.pid) - cpu0
            events = sum(e for _, e in results)
        print(f"phasewatch overhead ({args.requests} sequential requests, {args.tokens}-token streams; "
              f"{args.concurrency * 4} streams at concurrency {args.concurrency})")
        print(f"  TTFT direct      p50 {statistics.median(direct) * 1e3:7.2f} ms   p99 {pct(direct, .99) * 1e3:7.2f} ms")
        print(f"  TTFT via proxy   p50 {statistics.median(via) * 1e3:7.2f} ms   p99 {pct(via, .99) * 1e3:7.2f} ms")
        print(f"  added TTFT       p50 {statistics.median(added) * 1e3:7.2f} ms   p99 {pct(added, .99) * 1e3:7.2f} ms")
        print(f"  proxy CPU        {cpu * 1e6 / max(1, events):7.1f} µs per streamed event "
              f"({events} events, {events / wall:,.0f} events/s through the proxy)")
    finally:
        proxy.stop()
        sim.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--speed", type=float, default=10000.0,
                   help="simulator time scale: large means no inter-token delay")
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
