"""Benchmark mode of the real-engine harness: the seeds' "what to report" row per engine.

    .venv/bin/python -m tests.real.bench_real [--engine llama|vllm|both] [--reps 3]
        [--decode-tokens 128] [--long-prompt 2000]

Starts each engine (as the `real_engine` tests do) with a phasewatch proxy in front, sends
greedy streams through the proxy, and prints decode tok/s, prefill ms/token at a long
prompt and TTFT, phasewatch's figures (its per-request log line) beside the engine's own:
llama-server's `timings` (the client asks for usage, so they reach it unstripped) and
vLLM's /metrics (time_to_first_token, request_prefill_time, request_decode_time sums).
Medians over --reps runs. Not a test: run it on demand (CPU-only; expect noise when the
machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid

from ..support.servers import start_proxy
from . import engines as E
from .wire import capture, payloads, prom, total, wait_for


def med(values) -> float | None:
    """Median of the values that exist (a burst-delivered stream has no decode window)."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def f(line: dict, key: str) -> float | None:
    return float(line[key]) if key in line else None


def inv(x: float | None, scale: float = 1.0) -> float | None:
    return None if not x else scale / x


def _line(proxy, rid: str) -> dict:
    got, _ = wait_for(
        lambda: next((ln for ln in proxy.request_lines() if ln.get("request_id") == rid), None),
        10,
        what=f"log line of {rid}",
    )
    return got


def _words(n: int) -> str:
    base = (
        "the quick brown fox jumps over the lazy dog while the proxy counts every token "
        "of the prompt and the engine decodes one token per step"
    ).split()
    return " ".join(base[i % len(base)] for i in range(n))


def _llama_prompt(url: str, tokens: int) -> str:
    """A prompt of about `tokens` tokens, sized with the server's own /tokenize."""
    import httpx

    words = tokens
    for _ in range(4):
        text = _words(words)
        n = len(httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])
        if abs(n - tokens) <= 8:
            break
        words = max(1, int(words * tokens / max(n, 1)))
    return text


def _vllm_prompt(url: str, tokens: int) -> str:
    """A chat prompt of about `tokens` tokens (template included), sized with /tokenize."""
    import httpx

    words = tokens
    for _ in range(5):
        text = " ".join(["hello", "world", "proxy", "token"] * (words // 4 + 1)).split()[:words]
        text = " ".join(text)
        r = httpx.post(
            url + "/tokenize",
            timeout=30,
            json={"model": E.VLLM_MODEL, "messages": [{"role": "user", "content": text}]},
        )
        n = r.json()["count"]
        if tokens - 16 <= n <= tokens:
            break
        words = max(1, int(words * (tokens - 8) / max(n, 1)))
    return text


def bench_llama(manifest: dict, reps: int, decode_tokens: int, long_prompt: int) -> list[tuple]:
    engine = E.start_llama_server(manifest)
    proxy = start_proxy(f"llama={engine.url}")
    rows = []
    try:
        long_text = _llama_prompt(engine.url, long_prompt)

        def run(content: str, max_tokens: int) -> tuple[dict, dict]:
            rid = f"bench-{uuid.uuid4().hex[:12]}"
            body = {
                "model": E.LLAMA_ALIAS,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "seed": 42,
                "stream": True,
                "ignore_eos": True,
                "cache_prompt": False,
                "stream_options": {"include_usage": True},
            }
            cap = capture(
                proxy.url, "/v1/chat/completions", body, headers={"x-request-id": rid}, timeout=900
            )
            timings = [p for p in payloads(cap.body) if isinstance(p, dict) and "timings" in p][-1]
            return _line(proxy, rid), timings["timings"]

        run("warm up", 4)
        dec = [run("Name three colours of the rainbow.", decode_tokens) for _ in range(reps)]
        pre = [run(long_text, 8) for _ in range(reps)]
        rows += [
            (
                "llama-server",
                "decode tok/s",
                med(f(line, "decode_tps") for line, _ in dec),
                med(t["predicted_per_second"] for _, t in dec),
            ),
            (
                "llama-server",
                f"prefill ms/token @{pre[0][1]['prompt_n']} tok",
                med(inv(f(line, "prefill_tps"), 1000) for line, _ in pre),
                med(t["prompt_ms"] / t["prompt_n"] for _, t in pre),
            ),
            (
                "llama-server",
                f"TTFT s @{pre[0][1]['prompt_n']} tok (engine: prompt_ms)",
                med(f(line, "ttft_s") for line, _ in pre),
                med(t["prompt_ms"] / 1000 for _, t in pre),
            ),
            (
                "llama-server",
                "TTFT s, short prompt (engine: prompt_ms)",
                med(f(line, "ttft_s") for line, _ in dec),
                med(t["prompt_ms"] / 1000 for _, t in dec),
            ),
        ]
    finally:
        proxy.stop()
        engine.stop()
    return rows


def bench_vllm(manifest: dict, reps: int, decode_tokens: int, long_prompt: int) -> list[tuple]:
    engine = E.start_vllm(manifest)
    proxy = start_proxy(f"vllm={engine.url}")
    rows = []
    names = (
        "time_to_first_token_seconds_sum",
        "request_prefill_time_seconds_sum",
        "request_decode_time_seconds_sum",
        "e2e_request_latency_seconds_count",
    )
    try:
        long_prompt = min(long_prompt, 480)  # max-model-len 512

        def run(content: str, max_tokens: int) -> tuple[dict, dict]:
            rid = f"bench-{uuid.uuid4().hex[:12]}"
            before = prom(engine.url)
            body = {
                "model": E.VLLM_MODEL,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "seed": 42,
                "stream": True,
                "ignore_eos": True,
            }
            cap = capture(proxy.url, "/v1/chat/completions", body, headers={"x-request-id": rid})
            if cap.status != 200:
                raise RuntimeError(f"vLLM answered {cap.status}: {cap.body[:300]!r}")
            line = _line(proxy, rid)
            after, _ = wait_for(
                lambda: (
                    (s := prom(engine.url))
                    and total(s, "vllm:e2e_request_latency_seconds_count")
                    > total(before, "vllm:e2e_request_latency_seconds_count")
                    and s
                ),
                10,
                what="vLLM metrics",
            )
            d = {n: total(after, "vllm:" + n) - total(before, "vllm:" + n) for n in names}
            d["prompt_tokens"] = int(line["prompt_tokens"])
            d["completion_tokens"] = int(line["completion_tokens"])
            return line, d

        run("hello", 4)
        dec = [run("hello world", min(decode_tokens, 400)) for _ in range(reps)]
        pre = [run(_vllm_prompt(engine.url, long_prompt), 8) for _ in range(reps)]
        n_pre = pre[0][1]["prompt_tokens"]
        rows += [
            (
                "vLLM",
                "decode tok/s (engine: (n-1)/decode_time)",
                med(f(line, "decode_tps") for line, _ in dec),
                med(
                    inv(d["request_decode_time_seconds_sum"], d["completion_tokens"] - 1)
                    for _, d in dec
                ),
            ),
            (
                "vLLM",
                f"prefill ms/token @{n_pre} tok (phasewatch: proxy t_first - t_sent)",
                med(inv(f(line, "prefill_tps"), 1000) for line, _ in pre),
                med(
                    1000 * d["request_prefill_time_seconds_sum"] / d["prompt_tokens"]
                    for _, d in pre
                ),
            ),
            (
                "vLLM",
                f"TTFT s @{n_pre} tok",
                med(f(line, "ttft_s") for line, _ in pre),
                med(d["time_to_first_token_seconds_sum"] for _, d in pre),
            ),
            (
                "vLLM",
                "TTFT s, short prompt",
                med(f(line, "ttft_s") for line, _ in dec),
                med(d["time_to_first_token_seconds_sum"] for _, d in dec),
            ),
        ]
    finally:
        proxy.stop()
        engine.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("llama", "vllm", "both"), default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument(
        "--long-prompt",
        type=int,
        default=2000,
        help="prompt tokens for the prefill row (vLLM: capped at 480)",
    )
    args = ap.parse_args(argv)
    try:
        manifest = E.load_manifest()
    except E.EnginesMissing as exc:
        print(f"bench_real: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    rows = []
    if args.engine in ("llama", "both"):
        rows += bench_llama(manifest, args.reps, args.decode_tokens, args.long_prompt)
    if args.engine in ("vllm", "both"):
        rows += bench_vllm(manifest, args.reps, args.decode_tokens, args.long_prompt)
    w = max(len(r[1]) for r in rows)
    print(f"\n{'engine':13} {'figure':{w}} {'phasewatch':>11} {'engine':>11}")
    for eng, what, pw, own in rows:

        def cell(x: float | None) -> str:
            return f"{x:11.3f}" if x is not None else f"{'n/a':>11}"

        print(f"{eng:13} {what:{w}} {cell(pw)} {cell(own)}")
    if any(pw is None or own is None for _, _, pw, own in rows):
        print(
            "(n/a: no run gave the figure; phasewatch has no decode window when the "
            "engine's answer reached it in one read, as vLLM's API server does when starved "
            "of CPU)"
        )
    print(
        f"\n(medians of {args.reps}; llama-server: Gemma 3 270M Q4_K_M, -t 1; vLLM: tiny "
        f"random Llama fp32; {time.monotonic() - t0:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
