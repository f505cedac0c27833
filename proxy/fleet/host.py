"""What the worker processes of one host share, under ``--workers N``.

One process per host (worker 0, the *primary*) does the host-wide work — sampling GPU
power, probing and scraping the engines — and the others read its results from small
files in the workers' private folder, so the engines are probed once, not N times, and
energy counts once.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Host:
    """This process's place among the host's workers."""

    folder: str  # the workers' private folder (also prometheus-client's)
    index: int
    workers: int

    @property
    def primary(self) -> bool:
        return self.index == 0

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)


#: This process's start secret, when it runs alone (no --workers).
_PROCESS_SECRET = secrets.token_bytes(32)


def start_secret(host: Host | None) -> bytes:
    """32 random bytes made once per start of phasewatch, the same in each of its workers
    (the first worker to need them writes them to the workers' private folder; a worker
    restarted by the supervisor reads the same). What is keyed with them (the page
    cookie, the default prefix-affinity key) ends with the process."""
    if host is None:
        return _PROCESS_SECRET
    path = host.path("start.secret")
    try:
        with open(path, "rb") as f:
            got = f.read()
        if len(got) == 32:
            return got
    except FileNotFoundError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)  # atomic, and fails where another worker was first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read()


class Board:
    """A JSON document one process writes (atomically) and the others read when it changed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: float | None = None

    def write(self, doc: dict[str, Any]) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)

    def read_if_changed(self) -> dict[str, Any] | None:
        """The document, when it changed since the last read (None otherwise)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self._seen:
            return None
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return None  # being replaced: the next look gets it
        self._seen = mtime
        return doc if isinstance(doc, dict) else None
