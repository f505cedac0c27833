"""Server protocols compared: uvicorn's h11, its httptools, and phasewatch's own.

Why it exists: phasewatch needs a request-head limit, a header deadline and more before
any application code runs. uvicorn's h11 protocol has a head limit built in; its
httptools protocol has none of them, so phasewatch runs its own guarded protocol on
httptools (proxy/runtime/http1.py). This measures, in one run on one machine, what each
costs per request: the same trivial ASGI app under each protocol in its own process,
driven by keep-alive raw-socket clients, rounds interleaved. It prints requests/s and the
server's CPU per request (utime+stime from /proc); it asserts nothing. ``--compare DIR``
adds the protocol of another checkout (before a change, say) to the same run.

    .venv/bin/python tests/bench/server_bench.py [--seconds 3] [--conns 32] [--rounds 3]
        [--compare DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVER = r"""
import sys, uvicorn
kind = sys.argv[1]
sys.path.insert(0, sys.argv[3])
try:
    from proxy.runtime.http1 import guarded_protocol
except ImportError:  # a checkout from before proxy.runtime.http1 (--compare)
    from proxy.runtime.protocol import guarded_protocol

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", b"11")]})
    await send({"type": "http.response.body", "body": body})

http = kind if kind in ("h11", "httptools") else guarded_protocol(65536, 10.0, lambda r: None)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), http=http, log_level="warning",
            access_log=False, lifespan="on")
"""

REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"authorization: Bearer k\r\nuser-agent: bench\r\ncontent-length: 2\r\n\r\n{}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client(port: int, until: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    n = 0
    buf = b""
    while time.monotonic() < until:
        writer.write(REQUEST)
        while b'{"ok":true}' not in buf:
            buf += await reader.read(65536)
        buf = buf.split(b'{"ok":true}', 1)[1]
        n += 1
    counts.append(n)
    writer.close()


async def drive(port: int, seconds: float, conns: int) -> int:
    counts: list[int] = []
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(port, until, counts) for _ in range(conns)))
    return sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compare", type=Path, help="another checkout's protocol, beside this one")
    args = ap.parse_args()
    roots = {"h11": ROOT, "httptools": ROOT, "phasewatch": ROOT}
    if args.compare is not None:
        roots["compared"] = args.compare.resolve()
    kinds = list(roots)
    procs, ports = {}, {}
    for kind in kinds:
        ports[kind] = free_port()
        procs[kind] = subprocess.Popen(
            [sys.executable, "-c", SERVER, kind, str(ports[kind]), str(roots[kind])]
        )
    time.sleep(2.0)
    rps: dict[str, list[float]] = {k: [] for k in kinds}
    us: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                c0 = cpu(procs[kind].pid)
                n = asyncio.run(drive(ports[kind], args.seconds, args.conns))
                used = cpu(procs[kind].pid) - c0
                rps[kind].append(n / args.seconds)
                us[kind].append(used / max(n, 1) * 1e6)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait()
    base = statistics.median(us["httptools"])
    print(f"{'protocol':<10} {'req/s':>9} {'CPU us/req':>11} {'vs httptools':>13}")
    for kind in kinds:
        med = statistics.median(us[kind])
        print(f"{kind:<10} {statistics.median(rps[kind]):>9,.0f} {med:>11.1f} {med / base:>12.2f}x")


if __name__ == "__main__":
    main()
