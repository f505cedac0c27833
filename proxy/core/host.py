"""What the worker processes of one host share, under ``--workers N``.

One process per host (worker 0, the *primary*) does the host-wide work — sampling GPU
power, probing and scraping the engines — and the others read its results from small
files in the workers' private folder, so the engines are probed once, not N times, and
energy counts once.
"""

from __future__ import annotations

import json
import os
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
