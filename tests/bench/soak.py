"""Load and soak: many concurrent streams through phasewatch, every byte checked, and the
proxy's memory watched over time and under stalled readers.

1. N concurrent streams directly to the (deterministic) simulator, then the same N
   through phasewatch: every response must be byte-identical; lost or corrupted
   streams are counted.
2. A soak: waves of concurrent streams for --duration seconds, the proxy's RSS sampled
   every second (start, max, end).
3. --stalled readers that request long streams and never read: the proxy's RSS after the
   engine has been held back.

    python tests/bench/soak.py --streams 1000 --duration 600 --stalled 200   # the full run
    python tests/bench/soak.py --smoke                                        # CI smoke run

It prints figures and exits non-zero only if a byte was lost or corrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.servers import start_proxy, start_sim

MODELS = (
    "meta-llama/Llama-3.1-8B-Instruct",
    "RedHatAI/Llama-3.1-8B-Instruct-FP8",
    "hugging-quants/Llama-3.1-8B-Instruct-AWQ-INT4",
)


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def body_for(i: int, tokens: int) -> dict:
    return {
        "model": MODELS[i % 3],
        "messages": [{"role": "user", "content": f"stream number {i}"}],
        "max_tokens": tokens,
        "stream": True,
        "ignore_eos": True,
    }


async def fetch(client: httpx.AsyncClient, url: str, body: dict) -> bytes:
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        return b"".join([c async for c in resp.aiter_raw()])


async def wave(url: str, n: int, tokens: int, offset: int = 0) -> list[bytes | BaseException]:
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        return await asyncio.gather(
            *(fetch(client, url, body_for(offset + i, tokens)) for i in range(n)),
            return_exceptions=True,
        )


def stall(url: str, n: int, tokens: int) -> list[socket.socket]:
    host, port = url.rsplit("/", 1)[1].split(":")
    socks = []
    for i in range(n):
        payload = json.dumps(body_for(10**6 + i, tokens)).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
        )
        socks.append(s)
    return socks


async def run(args) -> int:
    sim = start_sim(
        "vllm", speed=args.speed, deterministic=True, max_num_seqs=max(16, args.streams)
    )
    proxy = start_proxy(f"sim={sim.url}", args=["--log-format", "none"])
    pid = proxy.proc.pid
    try:
        rss0 = rss_mib(pid)
        t0 = time.monotonic()
        direct = await wave(sim.url, args.streams, args.tokens)
        via = await wave(proxy.url, args.streams, args.tokens)
        elapsed = time.monotonic() - t0
        lost = sum(1 for v in via if isinstance(v, BaseException))
        corrupted = sum(
            1
            for d, v in zip(direct, via)
            if not isinstance(v, BaseException) and not isinstance(d, BaseException) and d != v
        )
        direct_failed = sum(1 for d in direct if isinstance(d, BaseException))
        events = sum(v.count(b"\n\n") for v in via if isinstance(v, bytes))
        print(
            f"load: {args.streams} concurrent streams x {args.tokens} tokens through phasewatch: "
            f"{lost} lost, {corrupted} corrupted (direct failures {direct_failed}), "
            f"{events} events in {elapsed:.1f} s (both passes); proxy RSS {rss0:.0f} -> "
            f"{rss_mib(pid):.0f} MiB"
        )

        samples = [rss_mib(pid)]
        soak_end = time.monotonic() + args.duration
        waves = 0
        while time.monotonic() < soak_end:
            results = await wave(
                proxy.url, args.soak_concurrency, args.tokens, offset=waves * 10_000
            )
            lost += sum(1 for r in results if isinstance(r, BaseException))
            waves += 1
            samples.append(rss_mib(pid))
        print(
            f"soak: {waves} waves of {args.soak_concurrency} streams over {args.duration:.0f} s: "
            f"proxy RSS start {samples[0]:.0f} MiB, max {max(samples):.0f} MiB, end {samples[-1]:.0f} MiB"
        )

        if args.stalled:
            before = rss_mib(pid)
            socks = stall(proxy.url, args.stalled, args.stalled_tokens)
            await asyncio.sleep(args.stall_seconds)
            after = rss_mib(pid)
            print(
                f"stalled readers: {args.stalled} clients not reading {args.stalled_tokens}-token "
                f"streams: proxy RSS {before:.0f} -> {after:.0f} MiB "
                f"({(after - before) * 1024 / args.stalled:.0f} KiB per stalled stream)"
            )
            for s in socks:
                s.close()
        return 1 if (lost or corrupted) else 0
    finally:
        proxy.stop()
        sim.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--soak-concurrency", type=int, default=100)
    p.add_argument("--stalled", type=int, default=200)
    p.add_argument("--stalled-tokens", type=int, default=20000)
    p.add_argument("--stall-seconds", type=float, default=10.0)
    p.add_argument("--speed", type=float, default=20.0)
    p.add_argument("--smoke", action="store_true", help="a quick run for CI")
    args = p.parse_args()
    if args.smoke:
        args.streams, args.tokens, args.duration = 200, 16, 5.0
        args.soak_concurrency, args.stalled, args.stall_seconds = 50, 20, 3.0
    raise SystemExit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
