"""Finding 9 of the third hostile-wire pass: a supervisor killed outright (``kill -9``)
leaves its metrics folder behind; the next start removes it, and only folders that are
phasewatch's, this user's, and whose supervisor is gone."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from ...support.servers import start_proxy, start_sim, wait_for


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def _folders(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir() if p.name.startswith("phasewatch-metrics-")}


def test_a_killed_supervisors_metrics_folder_is_removed_at_the_next_start(tmp_path):
    env = {"TMPDIR": str(tmp_path)}
    # folders the next start must leave alone: a live pid's (this test's own), one whose
    # name carries no pid, and a file spelled like a folder
    keep = {f"phasewatch-metrics-{os.getpid()}-live", "phasewatch-metrics-nopid", "other"}
    for name in keep:
        (tmp_path / name).mkdir()
        (tmp_path / name / "counter_1.db").write_bytes(b"\0" * 4096)
    sim = start_sim("vllm", speed=10.0, deterministic=False)
    first = start_proxy(f"sim={sim.url}", args=["--workers", "2"], env=env)
    second = None
    pids: list[int] = []
    try:
        master = first.proc.pid
        pids = [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]
        ours = _folders(tmp_path) - keep
        assert len(ours) == 1 and f"-{master}-" in next(iter(ours))
        os.kill(master, signal.SIGKILL)
        first.proc.wait(timeout=10)
        wait_for(lambda: not [p for p in pids if _alive(p)], what="the workers gone")
        assert _folders(tmp_path) - keep == ours  # the kill left it (the finding)

        second = start_proxy(f"sim={sim.url}", args=["--workers", "2"], env=env)
        now = _folders(tmp_path) - keep
        assert not now & ours, "the killed supervisor's folder is still there"
        assert len(now) == 1 and f"-{second.proc.pid}-" in next(iter(now))
        for name in keep:  # not ours to remove
            assert (tmp_path / name / "counter_1.db").exists()
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if second is not None:
            second.stop()
        first.stop()
        sim.stop()
