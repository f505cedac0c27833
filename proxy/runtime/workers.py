"""``phasewatch serve --workers N``: N processes sharing one listening socket.

The parent binds the port, makes a private ``PROMETHEUS_MULTIPROC_DIR`` (removed when it
exits; one left by a supervisor that was killed is removed at the next start, see
:func:`_clean_stale`), and spawns N workers, each a whole proxy (``ProxyApp`` under the same uvicorn
server as a single process, graceful drain included). The kernel spreads connections
over the workers' accept calls.

Metrics: every worker writes its counters, histograms and gauges to memory-mapped files
in that folder (prometheus-client multiprocess mode); whichever worker answers
``/metrics`` reads them all, so counters and histograms are summed over the workers and
gauges are combined per their ``multiprocess_mode`` (in-flight and queued: ``livesum``,
only the living workers). When a worker dies its live gauges are dropped
(``mark_process_dead``) and it is started again with the same index.

One per host: worker 0 is the *primary* (:class:`proxy.fleet.host.Host`). Only the primary
samples GPU power, so energy is counted once, not N times; it writes the samples to memory
shared with every worker, and each worker publishes what it has in flight there, so every
worker's requests get their phase power and every sample is classified by what all of
them run. Only the primary probes and scrapes the engines (the others read its model lists
from a shared board), and only it listens on the separate metrics address
(--metrics-host/--metrics-port) when one is set. A restarted worker 0 is primary again.

Signals: the first SIGTERM/SIGINT is passed on to every worker (each drains its streams);
a second one is passed on too (the workers then exit at once). A parent killed outright
(SIGKILL, a crash) passes nothing on: each worker asks the kernel for a SIGTERM when its
parent dies (Linux's ``PR_SET_PDEATHSIG``) and also watches its parent's pid once a
second (elsewhere, and as a fallback), so no orphan worker keeps serving the port.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.process
import os
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from ..app import ProxyApp
from ..fleet.host import Host
from ..measure.metrics import MULTIPROC_ENV
from ..settings import Settings
from .logs import configure_logging
from .server import announce
from .server import run as run_server

log = logging.getLogger(__name__)


#: prctl(2) option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


def _follow_parent(parent: int) -> None:
    """Exit (SIGTERM: a drain, then out) when the supervisor `parent` is gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog below still holds
    if os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        log.warning("the supervisor (pid %d) is gone: this worker stops", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="phasewatch-parent-watch", daemon=True).start()


def _worker(
    given: dict[str, Any],
    index: int,
    sock: socket.socket,
    msock: socket.socket | None,
    parent: int | None = None,
) -> None:
    """Entry point of one worker process (spawned: a fresh interpreter)."""
    if parent is not None:
        _follow_parent(parent)
    settings = Settings(**given)
    configure_logging(settings.log_level, settings.log_format, worker=index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent turns ^C into SIGTERM
    app = ProxyApp(settings, host=Host(os.environ[MULTIPROC_ENV], index, settings.workers))
    metrics = [msock] if msock is not None and index == 0 else None
    run_server(app, [sock], metrics, announce_start=False)


def run(
    given: dict[str, Any], settings: Settings, sock: socket.socket, msock: socket.socket | None
) -> int:
    """Supervise `settings.workers` worker processes until they are all gone. `sock` (and
    `msock`, the metrics address's, served by worker 0) are bound by the caller."""
    n = settings.workers
    _clean_stale(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER}{os.getpid()}-")
    os.environ[MULTIPROC_ENV] = folder  # inherited by the spawned workers
    ctx = multiprocessing.get_context("spawn")
    procs: dict[int, multiprocessing.process.BaseProcess] = {}
    stopping = threading.Event()
    signals = 0

    def start(index: int) -> None:
        p = ctx.Process(
            target=_worker,
            args=(given, index, sock, msock, os.getpid()),
            name=f"phasewatch-worker-{index}",
            daemon=False,
        )
        p.start()
        procs[index] = p

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        stopping.set()
        for p in procs.values():
            if p.is_alive() and p.pid:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            start(i)
        log.info(
            "phasewatch: %d workers on %s:%d; their metrics are summed from one folder",
            n,
            settings.host,
            settings.port,
            extra={"fields": {"metrics_dir": folder}},
        )
        announce(sock, msock)
        while procs:
            for index, p in list(procs.items()):
                p.join(timeout=0.2 / len(procs))
                if p.exitcode is None:
                    continue
                del procs[index]
                _mark_dead(p.pid, folder)
                if not stopping.is_set():
                    log.warning(
                        "worker %d (pid %s) exited with %s; starting it again",
                        index,
                        p.pid,
                        p.exitcode,
                    )
                    start(index)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs.values():
            p.kill()
        sock.close()
        if msock is not None:
            msock.close()
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(MULTIPROC_ENV, None)


#: The metrics folder's name: this prefix, the supervisor's pid, a dash, mkdtemp's suffix.
_FOLDER = "phasewatch-metrics-"


def _clean_stale(tmp: str) -> None:
    """Remove the metrics folders that supervisors killed before their own clean-up left
    in `tmp`: only folders named as :func:`run` names them, owned by this user, not
    links, whose supervisor's pid is gone (a live pid, even another user's or a reused
    one, keeps its folder)."""
    removed = 0
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        if not name.startswith(_FOLDER):
            continue
        pid_text, dash, _ = name[len(_FOLDER) :].partition("-")
        if not dash or not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not os.path.lexists(path)
    if removed:
        log.info("removed %d metrics folder(s) left by supervisors that were killed", removed)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process of ours to judge
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


def _mark_dead(pid: int | None, folder: str) -> None:
    if pid is None:
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)
    except Exception:  # noqa: BLE001 - best effort: only live gauges are affected
        pass
