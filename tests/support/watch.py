"""What everyone else sees while one party is hostile: the proxy's health latency and the
gaps of a well-behaved client's stream, measured from outside, so a test can compare a
hostile run with a baseline measured in the same run.

The measuring runs in a process of its own (``python -m tests.support.watch``): threads
of the test's process would share its interpreter lock with the fake engines and the
hostile clients, and measure them instead of the proxy."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx


@dataclass
class Seen:
    """The worst health answer and the widest gap between stream events in one window."""

    health_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    events: int = 0

    @property
    def worst_health(self) -> float:
        return max(self.health_s, default=0.0)

    @property
    def worst_gap(self) -> float:
        return max(self.gaps_s, default=0.0)

    def __str__(self) -> str:
        return (
            f"health max {self.worst_health * 1000:.0f} ms over {len(self.health_s)}, "
            f"stream gap max {self.worst_gap * 1000:.0f} ms over {self.events} events"
        )


#: Rounds a same-run comparison may take: a box busy with other work stalls anyone now and
#: then for a moment, in a baseline or beside a hostile party; a hostile party that stalls
#: everyone does so in every round.
ROUNDS = 3


def within(base: Seen, hostile: Seen, slack: float) -> bool:
    """Whether nobody saw more than `slack` seconds beyond the baseline's worst."""
    return (
        hostile.worst_health <= base.worst_health + slack
        and hostile.worst_gap <= base.worst_gap + slack
    )


class Watch:
    """Health probes every `every` seconds and one streamed chat request for `model` (an
    engine that paces its events), in a child process, until the stream ends."""

    def __init__(self, url: str, model: str, every: float = 0.02) -> None:
        self.url = url
        self.model = model
        self.every = every
        self.seen = Seen()

    def __enter__(self) -> Watch:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.watch", self.url, self.model, str(self.every)],
            stdout=subprocess.PIPE,
            text=True,
        )
        return self

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    def wait(self, timeout: float = 120.0) -> Seen:
        out, _ = self._proc.communicate(timeout=timeout)
        assert self._proc.returncode == 0, out
        self.seen = Seen(**json.loads(out.strip().splitlines()[-1]))
        return self.seen

    def __exit__(self, *exc) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class _Measure:
    """The child process's side."""

    def __init__(self, url: str, model: str, every: float) -> None:
        self.url = url
        self.model = model
        self.every = every
        self.seen = Seen()
        self._done = threading.Event()

    def run(self) -> Seen:
        threads = [
            threading.Thread(target=self._health, daemon=True),
            threading.Thread(target=self._stream, daemon=True),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return self.seen

    def _health(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._done.is_set():
                t0 = time.monotonic()
                client.get(self.url + "/phasewatch/health").raise_for_status()
                self.seen.health_s.append(time.monotonic() - t0)
                self._done.wait(self.every)

    def _stream(self) -> None:
        body = {"model": self.model, "stream": True, "messages": [{"role": "user", "content": "x"}]}
        try:
            with (
                httpx.Client(timeout=60) as client,
                client.stream("POST", self.url + "/v1/chat/completions", json=body) as r,
            ):
                last = None
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        self.seen.gaps_s.append(now - last)
                    last = now
                    self.seen.events += 1
                    if line.strip() != "data: [DONE]":
                        json.loads(line[5:])
        finally:
            self._done.set()


if __name__ == "__main__":
    url, model, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
    print(json.dumps(asdict(_Measure(url, model, every).run())))
