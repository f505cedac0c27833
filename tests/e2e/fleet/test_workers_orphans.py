"""`phasewatch serve --workers 2` whose supervisor is killed outright: no orphan serves."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from ...support.servers import start_proxy, start_sim, wait_for


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def _serves(url: str) -> bool:
    host, port = url.rsplit("/", 1)[1].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def test_workers_exit_when_the_supervisor_is_killed():
    sim = start_sim("vllm", speed=10.0, deterministic=False)
    proxy = start_proxy(f"sim={sim.url}", args=["--workers", "2"])
    pids: list[int] = []
    try:
        master = proxy.proc.pid
        pids = [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]
        assert len(pids) >= 2
        assert _serves(proxy.url)
        os.kill(master, signal.SIGKILL)
        proxy.proc.wait(timeout=10)
        wait_for(
            lambda: not [pid for pid in pids if _alive(pid)],
            what="every worker gone with its parent",
        )
        assert not _serves(proxy.url)  # nobody holds the listening socket any more
    finally:
        for pid in pids:  # an orphan left by a failure must not outlive the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proxy.stop()
        sim.stop()
