"""Balancing a pool: least-loaded against round-robin on a fast and a slow replica, and
a replica killed under load (issue 24).

One run, one machine: two simulated vLLM engines serving the same model, one at
``--fast-speed``, one at ``--slow-speed`` (the simulator's physics scaled), behind one
phasewatch with ``--balance least-loaded``, then with ``--balance round-robin`` (fresh
engines each time, so neither policy inherits the other's caches or queues). A closed
loop of ``--concurrency`` clients sends ``--requests`` streamed chat requests; the client
measures TTFT (first event carrying content) and the run's throughput (completion tokens
per second, from phasewatch's log lines); phasewatch's log gives each replica's share.

Then the kill: least-loaded, the same load running, the fast replica SIGKILLed a third of
the way through. Reported: requests lost (a non-200 answer or a stream ended by an error
event: those in flight on the killed replica), requests that went on, and the time from
the kill to phasewatch marking the replica down (``phasewatch_upstream_up`` 0).

It asserts nothing: a benchmark, not a test.

    python tests/bench/balance_bench.py            # about a minute
    python tests/bench/balance_bench.py --smoke    # seconds; tests/e2e/tools/test_fleet_bench_smoke.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.support.servers import Server, start_proxy, start_sim  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one(
    client: httpx.AsyncClient, url: str, i: int, max_tokens: int
) -> tuple[bool, float, float]:
    """One streamed request: (whole answer, client-seen TTFT, whole time, in seconds)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    t0 = time.monotonic()
    ttft = float("nan")
    got = b""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return False, ttft, time.monotonic() - t0
            async for chunk in r.aiter_raw():
                if ttft != ttft and b'"content":"' in chunk and b'"content":""' not in chunk:
                    ttft = time.monotonic() - t0
                got += chunk
    except httpx.HTTPError:
        return False, ttft, time.monotonic() - t0
    return b"data: [DONE]" in got and b'"error"' not in got, ttft, time.monotonic() - t0


async def drive(url: str, n: int, concurrency: int, max_tokens: int, on_start=None):
    """A closed loop of `concurrency` clients sending `n` requests in all."""
    results: list[tuple[bool, float, float]] = []
    counter = iter(range(n))
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as c:

        async def worker() -> None:
            for i in counter:
                if on_start is not None:
                    on_start(i)
                results.append(await one(c, url, i, max_tokens))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return results, wall


def shares(proxy: Server) -> tuple[dict[str, int], int]:
    lines = proxy.request_lines()
    count: dict[str, int] = {}
    tokens = 0
    for x in lines:
        count[x["upstream"]] = count.get(x["upstream"], 0) + 1
        tokens += int(x.get("completion_tokens") or 0)
    return count, tokens


def compare(policy: str, args) -> dict:
    fast = start_sim("vllm", speed=args.fast_speed)
    slow = start_sim("vllm", speed=args.slow_speed)
    proxy = start_proxy(
        f"fast={fast.url}", f"slow={slow.url}", args=["--balance", policy, "--engine-scrape", "1"]
    )
    try:
        results, wall = asyncio.run(
            drive(proxy.url, args.requests, args.concurrency, args.max_tokens)
        )
        proxy.request_lines(at_least=len(results))
        count, tokens = shares(proxy)
        ttfts = [t for ok, t, _ in results if ok and t == t]
        whole = [e for ok, _, e in results if ok]
        return {
            "policy": policy,
            "ok": sum(1 for ok, _, _ in results if ok),
            "requests": len(results),
            "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
            "e2e_p50_ms": 1e3 * pct(whole, 0.5),
            "e2e_p99_ms": 1e3 * pct(whole, 0.99),
            "tok_s": tokens / wall,
            "req_s": len(results) / wall,
            "share_fast": count.get("fast", 0) / max(1, sum(count.values())),
            "share_slow": count.get("slow", 0) / max(1, sum(count.values())),
        }
    finally:
        proxy.stop()
        fast.stop()
        slow.stop()


def affinity(args, mode: str) -> dict:
    """Prefix caching across a pool: two llama-server engines (each keeps its last
    prompt's KV), conversations of 4 requests sharing a long system prompt, round-robin
    against --affinity prefix; the cached share of prompt tokens as phasewatch counts it
    (its log lines' cached_tokens)."""
    a = start_sim("llamacpp", speed=args.fast_speed)
    b = start_sim("llamacpp", speed=args.fast_speed)
    extra = ["--affinity", "prefix"] if mode == "prefix" else ["--balance", "round-robin"]
    proxy = start_proxy(f"a={a.url}", f"b={b.url}", args=[*extra, "--engine-scrape", "0"])
    try:
        model = httpx.get(a.url + "/v1/models").json()["data"][0]["id"]
        # conversations: runs of 4 requests sharing a system prompt, 6 prompts in turn
        systems = [f"You are assistant {k} of the support team. " * 30 for k in range(6)]
        n = 4 * max(6, args.requests // 32)

        async def run() -> None:
            async with httpx.AsyncClient(timeout=120) as c:
                for i in range(n):
                    body = {"model": model, "max_tokens": 4, "messages": [
                        {"role": "system", "content": systems[(i // 4) % len(systems)]},
                        {"role": "user", "content": f"question {i}"}]}  # fmt: skip
                    await c.post(proxy.url + "/v1/chat/completions", json=body)

        asyncio.run(run())
        lines = proxy.request_lines(at_least=n)
        prompt = sum(int(x.get("prompt_tokens") or 0) for x in lines)
        cached = sum(int(x.get("cached_tokens") or 0) for x in lines)
        return {"mode": mode, "requests": n, "cached_share": cached / max(1, prompt)}
    finally:
        proxy.stop()
        a.stop()
        b.stop()


def ejected_ms(proxy: Server, t_kill: float | None) -> float | None:
    """Milliseconds from the kill to the proxy's log line marking the replica down."""
    if t_kill is None:
        return None
    for line in proxy.log().splitlines():
        if "upstream fast " in line and "not answering" in line:
            stamp = line.split("ts=", 1)[1].split(" ", 1)[0]
            t = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
            return 1e3 * (t.timestamp() - t_kill)
    return None


def kill(args) -> dict:
    fast = start_sim("vllm", speed=args.fast_speed)
    slow = start_sim("vllm", speed=args.slow_speed)
    proxy = start_proxy(f"fast={fast.url}", f"slow={slow.url}", args=["--engine-scrape", "1"])
    killed: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:  # polls the gauge: the time the replica is seen down
        while not done.is_set():
            if "t" in killed and "down" not in killed:
                try:
                    text = httpx.get(proxy.url + "/metrics", timeout=5).text
                except httpx.HTTPError:
                    continue
                if 'phasewatch_upstream_up{engine="vllm",upstream="fast"} 0.0' in text:
                    killed["down"] = time.monotonic()
            time.sleep(0.01)

    def on_start(i: int) -> None:
        if i == args.requests // 3 and "t" not in killed:
            fast.proc.kill()
            killed["t"] = time.monotonic()
            killed["wall"] = time.time()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results, wall = asyncio.run(
            drive(proxy.url, args.requests, args.concurrency, args.max_tokens, on_start)
        )
        done.set()
        watcher.join(timeout=5)
        lost = sum(1 for ok, _, _ in results if not ok)
        return {
            "requests": len(results),
            "lost": lost,
            "concurrency": args.concurrency,
            # from the proxy's own log line (its clock), and as a client polling /metrics saw it
            "eject_ms": ejected_ms(proxy, killed.get("wall")),
            "seen_down_ms": 1e3 * (killed["down"] - killed["t"]) if "down" in killed else None,
        }
    finally:
        done.set()
        proxy.stop()
        fast.stop()
        slow.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fast-speed", type=float, default=8.0)
    ap.add_argument("--slow-speed", type=float, default=2.0)
    ap.add_argument("--smoke", action="store_true", help="a few requests: seconds")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.max_tokens = 24, 4, 16
    rows = [compare(p, args) for p in ("least-loaded", "round-robin")]
    k = kill(args)
    aff = [affinity(args, mode) for mode in ("round-robin", "prefix")]
    if args.json:
        print(json.dumps({"compare": rows, "kill": k, "affinity": aff}))
        return
    print(
        f"pool: fast (--speed {args.fast_speed}) + slow (--speed {args.slow_speed}), "
        f"{args.requests} streamed requests, {args.concurrency} clients, "
        f"{args.max_tokens} tokens each"
    )
    print(f"{'policy':<14}{'ok':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}"
          f"{'e2e p99':>10}{'tok/s':>8}{'req/s':>7}{'fast':>6}{'slow':>6}   (ms)")  # fmt: skip
    for r in rows:
        print(
            f"{r['policy']:<14}{r['ok']:>5}{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}"
            f"{r['e2e_p50_ms']:>10.0f}{r['e2e_p99_ms']:>10.0f}{r['tok_s']:>8.0f}"
            f"{r['req_s']:>7.1f}{r['share_fast']:>6.0%}{r['share_slow']:>6.0%}"
        )

    def ms(v: float | None) -> str:
        return f"{v:.0f} ms" if v is not None else "not seen"

    print(
        f"kill of the fast replica under load ({k['concurrency']} clients): "
        f"{k['lost']} of {k['requests']} requests lost, ejected after {ms(k['eject_ms'])} "
        f"(proxy's log), seen down on /metrics after {ms(k['seen_down_ms'])}"
    )
    rr, px = aff
    print(
        f"prefix cache, two llama-server engines, {rr['requests']} requests in runs of 4 "
        f"sharing one of 6 system prompts: cached share of prompt tokens {rr['cached_share']:.0%} round-robin, "
        f"{px['cached_share']:.0%} with --affinity prefix"
    )


if __name__ == "__main__":
    main()
