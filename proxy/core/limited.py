"""One log line when a limit triggers, however often a hostile client triggers it.

A limit hit by one request deserves a line; the same limit hit ten thousand times a
second must not flood the log (or become the attack). :class:`LimitedLog` writes the
first occurrence of each kind at once and then at most one line per interval per kind,
saying how many occurrences it folded in.
"""

from __future__ import annotations

import logging
import time


class LimitedLog:
    """Warnings per kind, at most one line per `interval` seconds for each."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._next: dict[str, float] = {}
        self._folded: dict[str, int] = {}

    def warning(self, kind: str, msg: str, *args: object) -> bool:
        """Log `msg` for `kind` unless a line for it went out less than `interval` ago;
        returns whether a line was written."""
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._folded[kind] = self._folded.get(kind, 0) + 1
            return False
        self._next[kind] = now + self.interval
        folded = self._folded.pop(kind, 0)
        fields = {"limit": kind}
        if folded:
            fields["since_last_line"] = str(folded)
        self.logger.warning(msg, *args, extra={"fields": fields})
        return True
