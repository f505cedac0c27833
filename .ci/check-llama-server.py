"""Prove a llama-server binary really generates: start it on a free loopback port with the
GGUF, wait for /health, ask /completion for a few tokens, stop it.

    python check-llama-server.py BINARY GGUF

Standard library only (runs in the engines' venv). Exit 0 and one line on success; exit 1
with the reason (exit code or signal, the end of the server's log) when the server dies,
never becomes healthy, or answers without generating. A binary built for instructions
this CPU lacks (AMX, AVX-512 from a `-march=native` build made elsewhere, or usable only
outside a VM) dies with SIGILL here, on its first decode, instead of in the test tier.
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
import urllib.error
import urllib.request

START_TIMEOUT_S = 120.0
GENERATE_TIMEOUT_S = 120.0
N_PREDICT = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def main() -> int:
    binary, gguf = sys.argv[1], sys.argv[2]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        binary,
        "-m",
        gguf,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "512",
        "-np",
        "1",
        "-t",
        "1",
        "-tb",
        "1",
        "--no-webui",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    fd, log_path = tempfile.mkstemp(prefix="pw-llama-check-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def fail(why: str) -> int:
        stop()
        with open(log_path, errors="replace") as fh:
            tail = "".join(fh.readlines()[-25:])
        print(
            f"llama-server check failed: {why}\ncommand: {' '.join(argv)}\n"
            f"last lines of its log ({log_path}):\n{tail}",
            file=sys.stderr,
        )
        return 1

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            return fail(f"the server {describe_exit(proc.returncode)} during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            return fail(f"not healthy after {START_TIMEOUT_S:.0f} s")
        time.sleep(0.2)

    body = json.dumps(
        {
            "prompt": "The capital of France is",
            "n_predict": N_PREDICT,
            "temperature": 0,
            "cache_prompt": False,
        }
    ).encode()
    req = urllib.request.Request(
        url + "/completion", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=GENERATE_TIMEOUT_S) as r:
            answer = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        time.sleep(0.5)  # let a crashing server finish dying, to report how it died
        if proc.poll() is not None:
            return fail(f"the server {describe_exit(proc.returncode)} while generating")
        return fail(f"/completion failed: {exc!r}")
    predicted = answer.get("tokens_predicted") or answer.get("timings", {}).get("predicted_n")
    if not predicted:
        return fail(f"/completion generated nothing: {json.dumps(answer)[:500]}")
    stop()
    os.unlink(log_path)
    print(f"generated {predicted} tokens: {answer.get('content', '')!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
