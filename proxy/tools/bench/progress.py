"""The bench's progress on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """One line per step, or a redrawn bar on a terminal."""

    def __init__(self, total: int, quiet: bool, stream=sys.stderr) -> None:
        self.total, self.done, self.quiet, self.stream = max(1, total), 0, quiet, stream
        self.tty = stream.isatty()
        self.t0 = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if self.quiet:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.monotonic() - self.t0
        eta = elapsed / self.done * (self.total - self.done)
        line = f"[{bar}] {self.done}/{self.total} {elapsed:5.0f}s (eta {eta:4.0f}s) {what}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        if not self.quiet:
            self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
            self.stream.flush()
