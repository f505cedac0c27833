"""Real servers for tests: the simulator and the proxy as subprocesses on loopback.

Each runs the real command line (``python -m proxy ...``) under uvicorn, on a free port,
and is stopped with SIGTERM (then SIGKILL) when the test is done.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition", interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; return that. Tests wait for
    conditions, never for a fixed time: these machines are shared and noisy."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running subprocess with an HTTP base URL."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    truth_path: Path | None = None
    extra: dict = field(default_factory=dict)

    def log(self) -> str:
        """The log's complete lines. A reader polling the file can catch a line half
        written (a write that crosses a page boundary lands page by page), and a test
        that parses the last line must not see its first half as the whole."""
        text = self.log_path.read_text(errors="replace")
        if self.proc.poll() is not None:
            return text  # nothing more is coming: an unfinished last line is all there is
        return text[: text.rfind("\n") + 1]

    def truth(self, at_least: int = 0, timeout: float = 30.0) -> list[dict]:
        """The simulator's ground-truth records (one per finished request); with
        `at_least`, once that many are written (the engine writes a request's record just
        after its last bytes, so a client may have its answer first)."""
        deadline = time.monotonic() + timeout
        while True:
            out = []
            if self.truth_path is not None and self.truth_path.exists():
                text = self.truth_path.read_text()
                out = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
            if len(out) >= at_least:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(out)} truth records, not {at_least}")
            time.sleep(0.02)

    def request_lines(self, at_least: int = 0, timeout: float = 30.0) -> list[dict]:
        """The proxy's per-request log lines, parsed from logfmt; with `at_least`, once
        that many are written. A client has its whole answer a moment before the proxy
        writes the request's line, so a test that just got a response waits for it."""
        deadline = time.monotonic() + timeout
        while True:
            out = [
                parse_logfmt(line.split("msg=request ", 1)[1])
                for line in self.log().splitlines()
                if "msg=request " in line
            ]
            if len(out) >= at_least:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(out)} request lines, not {at_least}:\n{self.log()}")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def parse_logfmt(text: str) -> dict:
    out = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] == " ":
            i += 1
        j = text.find("=", i)
        if j < 0:
            break
        key = text[i:j]
        i = j + 1
        if i < n and text[i] == '"':
            value, end = json.JSONDecoder().raw_decode(text, i)
            i = end
        else:
            end = text.find(" ", i)
            end = n if end < 0 else end
            value = text[i:end]
            i = end
        out[key] = value
    return out


def _probed(resp: httpx.Response) -> bool:
    """The proxy's readiness answer says every upstream was probed (up or not)."""
    try:
        return all(u["up"] is not None for u in resp.json()["upstreams"])
    except (ValueError, KeyError, TypeError):
        return False


def _spawn(
    args: list[str],
    port: int,
    ready_path: str,
    env: dict | None = None,
    timeout: float = 30.0,
    ready=lambda resp: resp.status_code < 500,
) -> tuple[subprocess.Popen, Path]:
    log = Path(tempfile.mkstemp(prefix="pw-", suffix=".log")[1])
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", *args],
        cwd=ROOT,
        env=full_env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode}):\n{log.read_text()}")
        try:
            if ready(httpx.get(url + ready_path, timeout=1.0)):
                return proc, log
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout}s:\n{log.read_text()}")


def start_sim(
    engine: str = "vllm",
    *,
    speed: float = 1.0,
    deterministic: bool = True,
    max_num_seqs: int = 16,
    jitter: float = 0.0,
    extra: list[str] | None = None,
    port: int | None = None,
) -> Server:
    port = port or free_port()
    truth = Path(tempfile.mkstemp(prefix="pw-truth-", suffix=".jsonl")[1])
    args = (
        [
            "simulate",
            "--engine",
            engine,
            "--port",
            str(port),
            "--speed",
            str(speed),
            "--max-num-seqs",
            str(max_num_seqs),
            "--jitter",
            str(jitter),
            "--truth-log",
            str(truth),
        ]
        + (["--deterministic"] if deterministic else [])
        + (extra or [])
    )
    ready = "/api/version" if engine == "ollama" else ("/health")
    proc, log = _spawn(args, port, ready)
    return Server(proc, f"http://127.0.0.1:{port}", log, truth)


def start_proxy(*upstreams: str, env: dict | None = None, args: list[str] | None = None) -> Server:
    port = free_port()
    cli = ["serve", "--port", str(port)]
    for u in upstreams:
        cli += ["--upstream", u]
    # ready once every upstream's engine was probed (detection runs in the background)
    proc, log = _spawn(cli + (args or []), port, "/phasewatch/ready", env=env, ready=_probed)
    return Server(proc, f"http://127.0.0.1:{port}", log)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page, keyed by (name, sorted label items)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for (n, items), value in samples.items():
        if n == name and all(dict(items).get(k) == v for k, v in labels.items()):
            total += value
    return total


def stream_chat(url: str, model: str, prompt: str, max_tokens: int) -> None:
    """One streamed chat completion through `url`, read to its end (ignore_eos: exactly
    `max_tokens` tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for _ in resp.iter_raw():
            pass
