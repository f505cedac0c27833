"""What phasewatch costs, beside nginx and a plain FastAPI+httpx passthrough (issue 7).

One run, one machine, rounds interleaved so every contender sees the same noise:

- upstream: tests/bench/sse_upstream.py, a raw asyncio SSE server (cheap in CPU);
- direct:   the client talks to the upstream itself;
- nginx:    nginx in front of it (proxy_buffering off, HTTP/1.1 keep-alive upstream);
- plain:    tests/bench/plain_passthrough.py, FastAPI + httpx with no instrumentation;
- bytes:    tests/bench/byte_relay.py (--byte-relay), a bare uvloop byte relay: no HTTP
            parsed, nothing measured, the floor of a Python proxy on this loop;
- pw:       ``phasewatch serve``; ``pw×N`` with --workers N;
- REV:      phasewatch as it was at git revision REV (--baseline, repeatable), run
            from a temporary ``git worktree`` (removed after): same-run before/after.

Scenarios: (a) concurrency 1, 64-token streams: TTFT, added vs direct at p50/p99;
(b) concurrency 64 and 256, 256-token streams with no inter-token delay: events/s and the
proxy's CPU per 1,000 events (utime+stime from /proc, every process of the proxy);
(c) 256 and 32 streams paced at 50 tok/s: client-seen decode rate, p99 inter-event gap,
CPU per event, context switches per event and how many of them were preemptions; (d) peak
RSS (VmHWM) of the proxy's largest process; (e) 2-token streams over 8 connections: CPU
per request, the part of (c)'s cost that is the request's own rather than its events'.
With --probe, beside each load of (b) and (c), new users: a request on a new
connection every 50 ms while the load runs, its TTFT ("new request TTFT": does a busy
proxy make new users wait?); their own CPU counts in the contender's. Medians over --rounds.
The client is a raw asyncio protocol (uvloop when installed) counting events on bytes.
It asserts nothing: a benchmark, not a test.

--pin runs each contender (nginx, phasewatch, ...) on a CPU of its own and everything else
(this harness and its client processes, the upstream) on the others, as on separate
machines: a client woken on the proxy's CPU cannot be served by the proxy yielding it.
--busy N adds N CPU-bound processes at the lowest priority, on every CPU (unpinned), as an
engine's own processes are beside a proxy on a GPU server.

    python tests/bench/relay_bench.py            # full run (a few minutes)
    python tests/bench/relay_bench.py --smoke    # seconds; CI runs this
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
#: Connections of the (e) scenario (short requests back to back on each).
SHORT_CONCURRENCY = 8
#: With --pin: the CPUs each contender runs on (empty: no pinning).
CONTENDER_CPUS: set[int] = set()


# --- processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid: int) -> list[int]:
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(f[11]) + int(f[12])
    return total / TICK


def context_switches(pids: list[int]) -> tuple[int, int]:
    """Times the processes' threads stopped running, summed: (voluntary, involuntary).
    Voluntary: a thread slept (on a paced stream, about one wake-up per event for a proxy
    that handles each alone). Involuntary: it was preempted with work left, here mostly
    by the client its own write has just woken on its CPU."""
    vol = invol = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            except OSError:
                continue  # the thread ended
            for line in status.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol += int(line.split()[1])
    return vol, invol


def peak_rss_mib(pids: list[int]) -> float:
    best = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    best = max(best, int(line.split()[1]))
        except OSError:
            continue
    return best / 1024


@dataclass
class Proc:
    name: str
    url: str
    popen: subprocess.Popen | None
    log: Path | None = None
    cleanup: list = field(default_factory=list)

    def pids(self) -> list[int]:
        return tree(self.popen.pid) if self.popen else []

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for fn in self.cleanup:
            fn()


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    path = "/" + url.removeprefix("http://").split("/", 1)[1] if url.count("/") > 2 else "/"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited early ({proc.returncode}):\n{log.read_text()}")
        try:
            with socket.create_connection((host, int(port)), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} did not start in {timeout}s:\n{log.read_text()}")


def spawn(
    name: str,
    argv: list[str],
    port: int,
    ready: str,
    env: dict | None = None,
    cwd: Path = ROOT,
    contender: bool = True,
) -> Proc:
    """`argv` started and waited for; a `contender` runs on CONTENDER_CPUS (--pin), the
    rest where this harness runs."""
    log = Path(tempfile.mkstemp(prefix="pw-bench-", suffix=".log")[1])
    popen = subprocess.Popen(
        argv,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=pinned if contender else None,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + ready, popen, log)
    return Proc(name, url, popen, log, [lambda: log.unlink(missing_ok=True)])


def pinned() -> None:
    """In a contender's child process, before it runs: onto CONTENDER_CPUS (--pin)."""
    if CONTENDER_CPUS:
        os.sched_setaffinity(0, CONTENDER_CPUS)


def pin_harness(pin: bool) -> set[int]:
    """With `pin`: this process (and so the upstream and client processes it starts
    afterwards) onto every CPU but the last, which is left to the contenders; returns
    the contenders' CPUs (empty without `pin`, or on a single CPU)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return set()
    CONTENDER_CPUS.clear()
    CONTENDER_CPUS.add(cpus[-1])
    os.sched_setaffinity(0, set(cpus[:-1]))
    return set(CONTENDER_CPUS)


def start_busy(n: int) -> list[subprocess.Popen]:
    """`n` CPU-bound neighbours at the lowest priority, free to run on every CPU."""
    everywhere = set(range(os.cpu_count() or 1))

    def low() -> None:
        os.sched_setaffinity(0, everywhere)
        os.nice(19)

    code = "while True:\n    pass\n"
    return [subprocess.Popen([PY, "-c", code], preexec_fn=low) for _ in range(n)]


def start_upstream(procs: int = 1) -> Proc:
    port = free_port()
    argv = [PY, str(HERE / "sse_upstream.py"), str(port), str(procs)]
    return spawn("upstream", argv, port, "/health", contender=False)


def start_plain(upstream: str) -> Proc:
    port = free_port()
    return spawn(
        "plain", [PY, str(HERE / "plain_passthrough.py"), str(port), upstream], port, "/health"
    )


def start_byte_relay(upstream: str) -> Proc:
    port = free_port()
    host_port = upstream.removeprefix("http://")
    return spawn("bytes", [PY, str(HERE / "byte_relay.py"), str(port), host_port], port, "/health")


def start_phasewatch(upstream: str, workers: int, root: Path = ROOT, name: str = "") -> Proc:
    """phasewatch from `root` (this checkout, or a baseline's worktree)."""
    port = free_port()
    argv = [
        PY,
        "-m",
        "proxy",
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        "--log-format",
        "none",
        "--log-level",
        "warning",
        "--power-source",
        "none",
    ]
    if workers != 1:
        argv += ["--workers", str(workers)]
    name = name or "pw" + (f"×{workers}" if workers != 1 else "")
    env = {"PYTHONPATH": str(root)}
    proc = spawn(name, argv, port, "/phasewatch/health", env=env, cwd=root)
    return proc


def baseline_worktree(rev: str) -> Path:
    """A temporary checkout of `rev` (the code before a change), removed at exit, its C
    parts built where it has any (setup.py), as an install of it would have them."""
    d = Path(tempfile.mkdtemp(prefix=f"pw-bench-{rev.replace('/', '_')}-"))
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(d), rev],
        check=True,
        capture_output=True,
    )
    if (d / "setup.py").exists():
        subprocess.run(
            [PY, "setup.py", "-q", "build_ext", "--inplace"], cwd=d, check=True, capture_output=True
        )
    return d


def remove_worktree(d: Path) -> None:
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(d)], capture_output=True
    )
    shutil.rmtree(d, ignore_errors=True)


NGINX_CONF = """
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    upstream engine {{ server {upstream}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None
    )


def start_nginx(upstream: str) -> Proc:
    binary = nginx_binary()
    d = tempfile.mkdtemp(prefix="pw-bench-nginx-")
    port = free_port()
    conf = Path(d) / "nginx.conf"
    conf.write_text(NGINX_CONF.format(d=d, port=port, upstream=upstream.removeprefix("http://")))
    log = Path(d) / "stdout.log"
    popen = subprocess.Popen(
        [binary, "-c", str(conf), "-p", d, "-e", f"{d}/error.log"],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=pinned,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", popen, log)
    return Proc("nginx", url, popen, log, [lambda: shutil.rmtree(d, ignore_errors=True)])


# --- the client -------------------------------------------------------------------------


class Stream:
    """What the client saw of one streamed response."""

    __slots__ = ("events", "gaps", "ok", "t0", "t_first", "t_last", "t_last_seen", "tokens")

    def __init__(self, tokens: int, t0: float) -> None:
        self.t0 = t0
        self.t_first = 0.0
        self.t_last = 0.0
        self.t_last_seen = 0.0
        self.events = 0
        self.gaps: list[float] | None = None
        self.tokens = tokens
        self.ok = False

    def rate(self) -> float | None:
        span = self.t_last - self.t_first
        return (self.tokens - 1) / span if self.tokens > 1 and span > 0 else None


class Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection running streams one after another. Events are
    counted on bytes (every SSE event here carries exactly two newlines), chunked framing
    is undone on the fly; no JSON is parsed."""

    def __init__(self) -> None:
        self.transport = None
        self.fut: asyncio.Future | None = None
        self.s: Stream | None = None
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(f"connection lost: {exc}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def request(self, path: str, body: bytes, tokens: int, gaps: bool) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        self.fut = loop.create_future()
        self.s = Stream(tokens, time.perf_counter())
        if gaps:
            self.s.gaps = []
        self.buf = b""
        self.head = True
        self.remaining = -1  # -1: expecting a chunk-size line; -2: expecting CRLF after data
        self.newlines = 0
        self.transport.write(
            b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json"
            b"\r\ncontent-length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        return self.fut

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        s = self.s
        buf = self.buf + data if self.buf else data
        pos = 0
        n = len(buf)
        if self.head:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            head = buf[:end].lower()
            if not head.startswith(b"http/1.1 200") or b"transfer-encoding: chunked" not in head:
                self.fut.set_exception(RuntimeError(f"unexpected response: {buf[:300]!r}"))
                self.transport.close()
                return
            self.head = False
            pos = end + 4
        newlines = 0
        finished = False
        while pos < n:
            rem = self.remaining
            if rem > 0:
                take = min(rem, n - pos)
                newlines += buf.count(b"\n", pos, pos + take)
                pos += take
                self.remaining = rem - take or -2
            elif rem == -2:
                if n - pos < 2:
                    break
                pos += 2
                self.remaining = -1
            else:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";")[0], 16)
                if size == 0:
                    if buf.find(b"\r\n", eol + 2) < 0:
                        break
                    finished = True
                    pos = n
                    break
                pos = eol + 2
                self.remaining = size
        self.buf = buf[pos:] if pos < n else b""
        if newlines:
            before = s.events
            self.newlines += newlines
            after = s.events = self.newlines >> 1
            last_token = s.tokens + 1  # event 1 is role-only, 2..N+1 carry tokens
            if before < 2 <= after:
                s.t_first = now
            if before < last_token <= after:
                s.t_last = now
            if s.gaps is not None and after > before and before >= 2:
                hi = min(after, last_token)
                if hi > before:
                    s.gaps.append(now - s.t_last_seen)
                    s.gaps.extend([0.0] * (hi - before - 1))
            if after > before:
                s.t_last_seen = now
        if finished:
            s.ok = True
            self.fut.set_result(s)


async def open_conn(url: str) -> Conn:
    host, port = url.removeprefix("http://").split(":")
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(Conn, host, int(port))
    return proto


def chat_body(tokens: int, interval: float) -> bytes:
    return json.dumps(
        {
            "model": "bench-model",
            "stream": True,
            "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hello"}],
            "x_interval": interval,
        }
    ).encode()


async def run_streams(
    url: str,
    concurrency: int,
    per_conn: int,
    tokens: int,
    interval: float = 0.0,
    gaps: bool = False,
    spread: float = 0.0,
    shard: tuple[int, int] = (0, 1),
) -> tuple[list[Stream], float]:
    """`concurrency` connections, `per_conn` streams each, back to back; connection k
    starts after spread * k / concurrency seconds (a steady state rather than a burst).
    `shard` (j, n): only connections j, j + n, ... of them (one client process's share)."""
    body = chat_body(tokens, interval)
    mine = range(shard[0], concurrency, shard[1])
    conns = await asyncio.gather(*(open_conn(url) for _ in mine))
    out: list[Stream] = []

    async def worker(c: Conn, k: int) -> None:
        if spread > 0:
            await asyncio.sleep(spread * k / concurrency)
        for _ in range(per_conn):
            out.append(await c.request("/v1/chat/completions", body, tokens, gaps))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c, k) for k, c in zip(mine, conns)))
        wall = time.perf_counter() - t0
    finally:
        for c in conns:
            c.transport.close()
    return out, wall


def _client_shard(args: tuple) -> tuple[list[tuple], float]:
    """One client process's share of a load (--client-procs): its streams, as tuples."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    streams, wall = asyncio.run(run_streams(*args))
    return [(s.tokens, s.t0, s.t_first, s.t_last, s.events, s.ok, s.gaps) for s in streams], wall


#: Client processes for the loads (--client-procs > 1), started once per run.
CLIENTS_POOL: list = []


async def run_load(*args, shards: int = 1) -> tuple[list[Stream], float]:
    """run_streams, in `shards` client processes when more than one (a single asyncio
    client tops out near 150,000 events/s: a ceiling for 4 proxy workers)."""
    concurrency = args[1]
    if shards <= 1 or concurrency < shards or not CLIENTS_POOL:
        return await run_streams(*args)
    pool = CLIENTS_POOL[0]
    parts = await asyncio.gather(
        *(
            asyncio.wrap_future(pool.submit(_client_shard, (*args, (j, shards))))
            for j in range(shards)
        )
    )
    out = []
    for rows, _ in parts:
        for tokens, t0, t_first, t_last, events, ok, gaps in rows:
            s = Stream(tokens, t0)
            s.t_first, s.t_last, s.events, s.ok, s.gaps = t_first, t_last, events, ok, gaps
            out.append(s)
    return out, max(wall for _, wall in parts)


# --- scenarios ---------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


async def scenario_ttft(targets: list[Proc], n: int, tokens: int) -> dict[str, list[float]]:
    """(a) concurrency 1, requests interleaved target by target."""
    conns = {t.name: await open_conn(t.url) for t in targets}
    body = chat_body(tokens, 0.0)
    ttft: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for c in conns.values():  # warm
            await c.request("/v1/chat/completions", body, tokens, False)
        for i in range(n):
            order = targets[i % len(targets) :] + targets[: i % len(targets)]
            for t in order:
                s = await conns[t.name].request("/v1/chat/completions", body, tokens, False)
                ttft[t.name].append(s.t_first - s.t0)
    finally:
        for c in conns.values():
            c.transport.close()
    return ttft


async def scenario_load(
    t: Proc,
    concurrency: int,
    per_conn: int,
    tokens: int,
    interval: float = 0.0,
    spread: float = 0.0,
    shards: int = 1,
    probing: bool = False,
) -> dict:
    """(b)/(c)/(e): one contender under load; CPU and context switches from /proc of
    all its processes. With `probing`, new users beside the load (:func:`probe`): the TTFT
    of a request on a new connection while the load runs."""
    pids = t.pids()
    cpu0, (vol0, invol0) = cpu_seconds(pids), context_switches(pids)
    stop = asyncio.Event()
    probes_task = asyncio.ensure_future(probe(t.url, stop)) if probing else None
    try:
        streams, wall = await run_load(
            t.url, concurrency, per_conn, tokens, interval, interval > 0, spread, shards=shards
        )
    finally:
        stop.set()
    probes = await probes_task if probes_task is not None else []
    vol, invol = context_switches(pids)
    cpu, vol, invol = cpu_seconds(pids) - cpu0, vol - vol0, invol - invol0
    events = sum(s.events for s in streams)
    res = {
        "events": events,
        "wall": wall,
        "eps": events / wall,
        "us_per_event": cpu * 1e6 / events if pids else float("nan"),
        "us_per_stream": cpu * 1e6 / len(streams) if pids and streams else float("nan"),
        "cs_per_event": (vol + invol) / events if pids else float("nan"),
        "preempted_per_event": invol / events if pids else float("nan"),
        "bad": sum(not s.ok for s in streams),
    }
    if interval > 0:
        rates = [r for s in streams if (r := s.rate()) is not None]
        gaps = [g for s in streams for g in (s.gaps or ())]
        res.update(
            rate_mean=statistics.fmean(rates),
            rate_p1=pct(rates, 0.01),
            gap_p99=pct(gaps, 0.99),
            gap_p50=pct(gaps, 0.5),
        )
    # a new stream's wait for its first token while the others run (every stream here
    # starts among the open ones: the steady state's TTFT under load)
    firsts = [s.t_first - s.t0 for s in streams if s.ok and s.t_first > 0]
    res.update(ttft_p50=pct(firsts, 0.5), ttft_p99=pct(firsts, 0.99))
    res.update(new_ttft_p50=pct(probes, 0.5))
    return res


#: A new user's request beside a load: its tokens, and the pause between two.
PROBE_TOKENS, PROBE_PAUSE = 8, 0.05


async def probe(url: str, stop: asyncio.Event) -> list[float]:
    """Until `stop` (at least once): a new connection, one short stream, its TTFT."""
    body = chat_body(PROBE_TOKENS, 0.0)
    out: list[float] = []
    while True:
        c = await open_conn(url)
        try:
            s = await c.request("/v1/chat/completions", body, PROBE_TOKENS, False)
            out.append(s.t_first - s.t0)
        finally:
            c.transport.close()
        if stop.is_set():
            return out
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), PROBE_PAUSE)


# --- the table -----------------------------------------------------------------------------


def fmt(v: float, unit: str = "") -> str:
    if v != v:
        return "—"
    if abs(v) >= 10000:
        return f"{v:,.0f}{unit}"
    if abs(v) >= 100:
        return f"{v:.0f}{unit}"
    if abs(v) >= 10:
        return f"{v:.1f}{unit}"
    return f"{v:.2f}{unit}"


def ratio(a: float, b: float) -> str:
    if a != a or b != b or b == 0:
        return "—"
    return f"{a / b:.2f}×"


def print_table(
    names: list[str],
    rows: list[tuple[str, dict[str, float], str]],
    ratios: list[tuple[str, str]],
    targets: list[tuple[str, str]],
    markdown: bool = False,
) -> None:
    """The table; `ratios`: (numerator, denominator) contender names, one column each."""
    head = ["metric"] + names + [f"{a}/{b}" for a, b in ratios] + ["target"]
    table = [head]
    for label, vals, unit in rows:
        line = [label] + [fmt(vals.get(n, float("nan")), unit) for n in names]
        line += [ratio(vals.get(a, float("nan")), vals.get(b, float("nan"))) for a, b in ratios]
        line.append(dict(targets).get(label, ""))
        table.append(line)
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("| --- |" + " --: |" * (len(head) - 2) + " --- |")
        for r in table[1:]:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for k, r in enumerate(table):
        print(
            "  "
            + "  ".join(
                c.ljust(widths[i]) if i in (0, len(head) - 1) else c.rjust(widths[i])
                for i, c in enumerate(r)
            )
        )
        if k == 0:
            print("  " + "  ".join("-" * w for w in widths))


def print_rounds(
    loads: dict[tuple[str, str], list[dict]],
    scenarios: list[tuple[str, str]],
    ratios: list[tuple[str, str]],
) -> None:
    """Each round's own ratio of CPU per event, for each (numerator, denominator) pair:
    within a round the contenders run back to back, so a round's ratio is a paired
    measurement, and its spread over the rounds says how far the median can be trusted
    on a machine whose speed drifts between runs. `scenarios`: (load key, row label)."""
    for a, b in ratios:
        lines = []
        for key, label in scenarios:
            num, den = loads.get((key, a)), loads.get((key, b))
            if not num or not den:
                continue
            per = [ratio(x["us_per_event"], y["us_per_event"]) for x, y in zip(num, den)]
            lines.append(f"    {label:<24} " + " ".join(per))
        if lines:
            print(f"  {a}/{b}, each round's ratio (the contenders back to back):")
            print("\n".join(lines))


# --- what --otel costs (optional: --otel) ----------------------------------------------------


def start_phasewatch_otel(upstream: str, sink: str) -> Proc:
    """``phasewatch serve --otel`` exporting spans and GenAI metrics to `sink`."""
    port = free_port()
    argv = [PY, "-m", "proxy", "serve", "--upstream", upstream, "--port", str(port)]
    argv += ["--log-format", "none", "--log-level", "warning", "--power-source", "none"]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink, "OTEL_METRIC_EXPORT_INTERVAL": "5000"}
    return spawn("pw×1+otel", argv + ["--otel"], port, "/phasewatch/health", env)


async def otel_cost(args, upstream: str) -> None:
    """phasewatch with and without --otel, rounds interleaved: added TTFT at concurrency 1,
    CPU per request on short streams (where per-request work shows), and CPU per event on
    long ones (where it must not)."""
    port = free_port()
    sink = spawn("otlp-sink", [PY, str(HERE / "otlp_sink.py"), str(port)], port, "/")
    plain = start_phasewatch(upstream, 1, name="pw×1")
    traced = start_phasewatch_otel(upstream, sink.url)
    short, long_ = 8, args.tokens
    res: dict[str, dict[str, list[float]]] = {t.name: {} for t in (plain, traced)}
    try:
        for rnd in range(args.rounds):
            order = [plain, traced] if rnd % 2 == 0 else [traced, plain]
            for n, v in (await scenario_ttft(order, args.ttft_requests, 64)).items():
                res[n].setdefault("ttft_p50", []).append(pct(v, 0.5) * 1e3)
            for t in order:
                r = await scenario_load(t, 16, max(1, args.streams // 4), short)
                streams = 16 * max(1, args.streams // 4)
                res[t.name].setdefault("us_req", []).append(
                    r["us_per_event"] * r["events"] / streams
                )
                r = await scenario_load(t, 64, max(1, args.streams // 64), long_)
                res[t.name].setdefault("us_event", []).append(r["us_per_event"])
        p, o = res[plain.name], res[traced.name]
        print()
        print(
            f"--otel: {args.rounds} round(s), medians; spans and GenAI metrics to a local OTLP sink"
        )
        print(f"| metric | {plain.name} | {traced.name} | added by --otel |")
        print("| --- | --: | --: | --: |")
        for label, key in (
            ("(a) TTFT p50 ms, concurrency 1", "ttft_p50"),
            (f"CPU µs/request, {short}-token streams, c16", "us_req"),
            (f"CPU µs/event, {long_}-token streams, c64", "us_event"),
        ):
            a, b = med(p[key]), med(o[key])
            print(f"| {label} | {fmt(a)} | {fmt(b)} | {fmt(b - a)} |")
    finally:
        for t in (plain, traced, sink):
            t.stop()


def print_scaling(args, ws: list[str], loads: dict[tuple[str, str], list[dict]]) -> None:
    """The --workers curve: events/s and CPU per event at each worker count, per load.
    Under the paced loads the offered rate is fixed, so what scales there is the CPU per
    event (and whether the rate holds); under (b) it is events/s, up to the ceiling of
    the client and upstream (the direct column; see --client-procs, --upstream-procs)."""
    print()
    print(
        f"--workers scaling ({os.cpu_count()} CPUs, {args.client_procs} client process(es), "
        f"{args.upstream_procs} upstream process(es), medians)"
    )
    print("| load | " + " | ".join(ws) + " |")
    print("| --- |" + " --: |" * len(ws))
    keys = [(f"c{c}", f"(b) c{c}") for c in args.concurrency]
    keys += [(f"paced{n}", f"(c) p{n}") for n in args.paced_streams]
    for key, label in keys:
        eps = [med([r["eps"] for r in loads[(key, w)]]) for w in ws]
        cpu = [med([r["us_per_event"] for r in loads[(key, w)]]) for w in ws]
        print(
            f"| {label} events/s | "
            + " | ".join(f"{e:,.0f} ({e / eps[0]:.2f}×)" for e in eps)
            + " |"
        )
        print(f"| {label} CPU µs/event | " + " | ".join(fmt(c) for c in cpu) + " |")
    for c in args.concurrency:  # one line per load, for a quick read
        eps = [med([r["eps"] for r in loads[(f"c{c}", w)]]) for w in ws]
        cpu = [med([r["us_per_event"] for r in loads[(f"c{c}", w)]]) for w in ws]
        print(
            f"  scaling c{c}: "
            + ", ".join(
                f"{w} {e:,.0f} events/s ({e / eps[0]:.2f}×, {fmt(u)} µs/event)"
                for w, e, u in zip(ws, eps, cpu)
            )
        )


# --- main ------------------------------------------------------------------------------------


async def bench(args) -> int:
    contender_cpus = pin_harness(args.pin)
    if args.pin and not contender_cpus:
        print("(--pin needs 2 CPUs or more: not pinned)")
    up = start_upstream(args.upstream_procs)
    procs: list[Proc] = []
    busy = start_busy(args.busy)
    if args.client_procs > 1:
        ctx = multiprocessing.get_context("spawn")
        CLIENTS_POOL.append(ProcessPoolExecutor(args.client_procs, mp_context=ctx))
    try:
        direct = Proc("direct", up.url, None)
        if args.nginx and nginx_binary():
            procs.append(start_nginx(up.url))
        elif args.nginx:
            print("(nginx not found: its column is left out)")
        if args.plain:
            procs.append(start_plain(up.url))
        if args.byte_relay:
            procs.append(start_byte_relay(up.url))
        for w in args.workers:
            procs.append(start_phasewatch(up.url, w))
        baselines = []
        for rev in args.baseline:
            tree_dir = baseline_worktree(rev)
            procs.append(start_phasewatch(up.url, 1, root=tree_dir, name=rev))
            procs[-1].cleanup.append(lambda d=tree_dir: remove_worktree(d))
            baselines.append(rev)
        targets = [direct] + procs
        names = [t.name for t in targets]
        pw = "pw"
        ratios = [(pw, "nginx")] if any(t.name == "nginx" for t in procs) else []
        if args.byte_relay:
            ratios.append((pw, "bytes"))
        ratios += [(pw, b) for b in baselines]
        if len(baselines) > 1:
            ratios.append((baselines[0], baselines[1]))

        ttft = {n: [] for n in names}
        loads: dict[tuple[str, str], list[dict]] = {}
        for rnd in range(args.rounds):
            t_round = time.perf_counter()
            for n, values in (await scenario_ttft(targets, args.ttft_requests, 64)).items():
                ttft[n].append(values)
            order = targets[rnd % len(targets) :] + targets[: rnd % len(targets)]
            for c in args.concurrency:
                for t in order:
                    r = await scenario_load(
                        t,
                        c,
                        max(1, args.streams // c),
                        args.tokens,
                        shards=args.client_procs,
                        probing=args.probe,
                    )
                    loads.setdefault((f"c{c}", t.name), []).append(r)
            for n_paced in args.paced_streams:
                for t in order:
                    # Steady state: stream starts spread over one stream's duration, then
                    # each connection streams again at once, so ~N streams are always open.
                    r = await scenario_load(
                        t,
                        n_paced,
                        args.paced_repeat,
                        args.paced_tokens,
                        1.0 / args.paced_rate,
                        spread=args.paced_tokens / args.paced_rate,
                        shards=args.client_procs,
                        probing=args.probe,
                    )
                    loads.setdefault((f"paced{n_paced}", t.name), []).append(r)
            if args.short_requests:
                for t in order:
                    # what a request costs apart from its events: 2-token streams
                    r = await scenario_load(
                        t, SHORT_CONCURRENCY, max(1, args.short_requests // SHORT_CONCURRENCY), 2
                    )
                    loads.setdefault(("short", t.name), []).append(r)
            print(
                f"(round {rnd + 1}/{args.rounds}: {time.perf_counter() - t_round:.1f} s)",
                flush=True,
            )

        rows: list[tuple[str, dict[str, float], str]] = []
        d = "direct"
        rows.append(
            ("(a) TTFT p50 ms", {n: med([pct(v, 0.5) * 1e3 for v in ttft[n]]) for n in names}, "")
        )
        rows.append(
            (
                "(a) added TTFT p50 ms",
                {
                    n: med([(pct(v, 0.5) - pct(dv, 0.5)) * 1e3 for v, dv in zip(ttft[n], ttft[d])])
                    for n in names
                    if n != d
                },
                "",
            )
        )
        rows.append(
            (
                "(a) added TTFT p99 ms",
                {
                    n: med(
                        [(pct(v, 0.99) - pct(dv, 0.99)) * 1e3 for v, dv in zip(ttft[n], ttft[d])]
                    )
                    for n in names
                    if n != d
                },
                "",
            )
        )
        for c in args.concurrency:
            rows.append(
                (
                    f"(b) c{c} events/s",
                    {n: med([r["eps"] for r in loads[(f"c{c}", n)]]) for n in names},
                    "",
                )
            )
            if args.probe:
                key = f"c{c}"
                rows.append(
                    (
                        f"(b) c{c} new request TTFT p50 ms",
                        {n: med([r["new_ttft_p50"] * 1e3 for r in loads[(key, n)]]) for n in names},
                        "",
                    )
                )
            rows.append(
                (
                    f"(b) c{c} CPU µs/event",
                    {
                        n: med([r["us_per_event"] for r in loads[(f"c{c}", n)]])
                        for n in names
                        if n != d
                    },
                    "",
                )
            )
        for n_paced in args.paced_streams:
            p = f"paced{n_paced}"
            rows.append(
                (
                    f"(c) p{n_paced} CPU µs/event",
                    {n: med([r["us_per_event"] for r in loads[(p, n)]]) for n in names if n != d},
                    "",
                )
            )
            # the engine's own wait for a first token is in every column (direct's):
            # what a proxy adds is read against it
            ttft50 = {n: med([r["ttft_p50"] * 1e3 for r in loads[(p, n)]]) for n in names}
            rows.append((f"(c) p{n_paced} TTFT p50 ms", ttft50, ""))
            if args.probe:
                rows.append(
                    (
                        f"(c) p{n_paced} new request TTFT p50 ms",
                        {n: med([r["new_ttft_p50"] * 1e3 for r in loads[(p, n)]]) for n in names},
                        "",
                    )
                )
            rows.append(
                (
                    f"(c) p{n_paced} added TTFT p50 ms",
                    {n: ttft50[n] - ttft50[d] for n in names if n != d},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} TTFT p99 ms",
                    {n: med([r["ttft_p99"] * 1e3 for r in loads[(p, n)]]) for n in names},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} decode tok/s mean",
                    {n: med([r["rate_mean"] for r in loads[(p, n)]]) for n in names},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} decode tok/s p1",
                    {n: med([r["rate_p1"] for r in loads[(p, n)]]) for n in names},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} gap p99 ms",
                    {n: med([r["gap_p99"] * 1e3 for r in loads[(p, n)]]) for n in names},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} context switches/event",
                    {n: med([r["cs_per_event"] for r in loads[(p, n)]]) for n in names if n != d},
                    "",
                )
            )
            rows.append(
                (
                    f"(c) p{n_paced} preemptions/event",
                    {
                        n: med([r["preempted_per_event"] for r in loads[(p, n)]])
                        for n in names
                        if n != d
                    },
                    "",
                )
            )
        if args.short_requests:
            rows.append(
                (
                    f"(e) c{SHORT_CONCURRENCY} CPU µs/request, 2-token streams",
                    {
                        n: med([r["us_per_stream"] for r in loads[("short", n)]])
                        for n in names
                        if n != d
                    },
                    "",
                )
            )
        rows.append(("(d) peak RSS MiB/proc", {t.name: peak_rss_mib(t.pids()) for t in procs}, ""))
        goals = [
            ("(a) added TTFT p50 ms", "≤ 0.5"),
            ("(d) peak RSS MiB/proc", "≤ 100"),
        ]
        for n_paced in args.paced_streams:
            goals += [
                (f"(c) p{n_paced} CPU µs/event", "≤ 2× nginx"),
                (f"(c) p{n_paced} added TTFT p50 ms", "≤ 2× nginx + 1 ms"),
                (f"(c) p{n_paced} decode tok/s mean", f"{args.paced_rate:g} ± 1 %"),
            ]
        goals += [(f"(b) c{c} CPU µs/event", "≤ 2× nginx") for c in args.concurrency]
        goals += [
            (f"(b) c{c} new request TTFT p50 ms", "≤ 2× nginx + 1 ms") for c in args.concurrency
        ]
        goals += [
            (f"(c) p{n} new request TTFT p50 ms", "≤ 2× nginx + 1 ms") for n in args.paced_streams
        ]

        bad = sum(r["bad"] for rs in loads.values() for r in rs)
        print()
        print(
            f"relay benchmark: {args.rounds} round(s), medians; (a) {args.ttft_requests} "
            f"sequential 64-token streams per contender and round; (b) {args.tokens}-token "
            f"streams, {args.streams} per concurrency level, no delay; (c) "
            f"{'/'.join(map(str, args.paced_streams))} "
            f"connections × {args.paced_repeat} streams × {args.paced_tokens} tokens at "
            f"{args.paced_rate:g} tok/s, starts spread (steady state); (e) "
            f"{args.short_requests} 2-token streams over {SHORT_CONCURRENCY} connections "
            "(the per-request cost, apart from the events); "
            f"{os.cpu_count()} CPUs"
            + (
                f"; pinned: contenders on CPU {sorted(contender_cpus)}, the rest on the others"
                if contender_cpus
                else ""
            )
            + (f"; {args.busy} busy neighbour(s) at nice 19, unpinned" if args.busy else "")
            + (f"; INCOMPLETE STREAMS: {bad}" if bad else "")
        )
        print(
            "CPU columns: utime+stime of the contender's processes only (not the client, "
            "not the upstream); the direct column's events/s is the client+upstream ceiling"
        )
        print_table(names, rows, ratios, goals)
        print()
        print_rounds(
            loads,
            [(f"c{c}", f"(b) c{c} CPU µs/event") for c in args.concurrency]
            + [(f"paced{n}", f"(c) p{n} CPU µs/event") for n in args.paced_streams],
            ratios,
        )
        print()
        print_table(names, rows, ratios, goals, markdown=True)
        ws = [t.name for t in procs if t.name.startswith(pw)]
        if len(ws) > 1:
            print_scaling(args, ws, loads)
        if args.otel:
            await otel_cost(args, up.url)
        return 1 if bad else 0
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for p in procs:
            p.stop()
        up.stop()
        for pool in CLIENTS_POOL:
            pool.shutdown()
        CLIENTS_POOL.clear()


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds, tiny loads (CI)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1],
        help="phasewatch worker counts to run, comma separated [1]; more than "
        "one prints the scaling curve (e.g. 1,2,4)",
    )
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes the loads are spread over (a many-core machine: as many "
        "as the proxy has workers, so the client is not the ceiling) [1]",
    )
    p.add_argument(
        "--upstream-procs",
        type=int,
        default=1,
        help="upstream processes sharing its port (SO_REUSEPORT) [1]",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="REV",
        help="also run phasewatch as at git revision REV, from a temporary worktree; "
        "repeatable (e.g. --baseline 5dd6620)",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="each contender on the last CPU, the harness, clients and upstream on the others",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="new users beside each load: a request on a new connection every 50 ms, its "
        "TTFT (their CPU counts in the contender's)",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="N CPU-bound neighbours at nice 19 on every CPU during the run [0]",
    )
    p.add_argument("--no-nginx", dest="nginx", action="store_false")
    p.add_argument(
        "--no-plain",
        dest="plain",
        action="store_false",
        help="leave out the plain FastAPI+httpx passthrough (slow under paced load)",
    )
    p.add_argument(
        "--byte-relay",
        action="store_true",
        help="also run a bare uvloop byte relay (tests/bench/byte_relay.py): the floor of "
        "a Python proxy on this loop, beside which phasewatch's own work is read",
    )
    p.add_argument("--ttft-requests", type=int, default=100)
    p.add_argument("--concurrency", type=_ints, default=[64, 256], help="(b) levels; '' skips (b)")
    p.add_argument(
        "--streams",
        type=int,
        default=256,
        help="streams per contender in (b), spread over the connections",
    )
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument(
        "--paced-streams", type=_ints, default=[256, 32], help="(c) levels; '' skips (c)"
    )
    p.add_argument("--paced-tokens", type=int, default=100)
    p.add_argument(
        "--paced-repeat", type=int, default=3, help="streams per connection in (c), back to back"
    )
    p.add_argument("--paced-rate", type=float, default=50.0)
    p.add_argument(
        "--short-requests",
        type=int,
        default=2000,
        help="(e) 2-token streams per contender and round, for the cost of a request "
        "apart from its events; 0 skips (e) [2000]",
    )
    p.add_argument(
        "--otel", action="store_true", help="also measure what --otel adds (spans to a local sink)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.ttft_requests, args.concurrency, args.streams = 1, 5, [8], 8
        args.tokens, args.paced_streams, args.paced_tokens, args.paced_repeat = 32, [8], 10, 1
        args.short_requests = 40
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
