"""Tools for hostile-wire tests: the events an engine's script streams, raw-socket clients,
/proc readings.

The engine itself is the shared :class:`tests.support.fake_engine.FakeEngine`; a hostile
test gives it a script (``FakeEngine(models=[MODEL], script=...)``) that decides every byte
it sends: CRLF framing cut anywhere, Content-Length on a stream, a reset mid-event.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

MODEL = "m"


def token_event(text: str, finish: str | None = None, nl: bytes = b"\n") -> bytes:
    """A compact OpenAI chat chunk as one SSE event."""
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + nl + nl


def usage_event(nl: bytes = b"\n") -> bytes:
    obj = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
    }
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + nl + nl


# --- raw-socket clients ----------------------------------------------------------------------


@contextmanager
def full_backlog() -> Iterator[int]:
    """A port whose accept queue is full: new SYNs are dropped, a connect never completes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            fillers.append(s)
        yield port
    finally:
        for s in fillers:
            s.close()
        listener.close()


def closed_port() -> int:
    """A port nothing listens on: a connect is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(url: str, timeout: float = 10.0) -> socket.socket:
    host, port = url.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    return s


def read_all(s: socket.socket, limit: int = 1 << 22) -> bytes:
    """Everything until the server closes (at most `limit` bytes)."""
    out = []
    size = 0
    while size < limit:
        try:
            data = s.recv(65536)
        except TimeoutError:
            break
        if not data:
            break
        out.append(data)
        size += len(data)
    return b"".join(out)


def read_response(s: socket.socket) -> bytes:
    """One HTTP response read to its end (Content-Length or chunked), not to EOF; a
    response with neither is read to EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = s.recv(65536)
        if not piece:
            return data
        data += piece
    head, _, rest = data.partition(b"\r\n\r\n")
    if head.startswith(b"HTTP/1.1 1"):  # an interim answer: the final one follows
        return head + b"\r\n\r\n" + _read_more(s, rest)
    length = None
    chunked = False
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
        elif k.strip().lower() == b"transfer-encoding" and b"chunked" in v.lower():
            chunked = True
    status = int(head.split(b" ", 2)[1])
    if length is None and not chunked and status in (204, 304):
        length = 0
    while True:
        if length is not None and len(rest) >= length:
            break
        if chunked and (rest.endswith(b"\r\n0\r\n\r\n") or rest == b"0\r\n\r\n"):
            break
        piece = s.recv(65536)
        if not piece:
            break
        rest += piece
    return head + b"\r\n\r\n" + rest


def _read_more(s: socket.socket, data: bytes) -> bytes:
    class _Buffered:
        def __init__(self) -> None:
            self.data = data

        def recv(self, n: int) -> bytes:
            if self.data:
                out, self.data = self.data, b""
                return out
            return s.recv(n)

    return read_response(_Buffered())  # type: ignore[arg-type]


# --- /proc -------------------------------------------------------------------------------------


def status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM), where the kernel allows it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Growth of a process's resident memory over a block: the peak (VmHWM) when it can
    be reset, else the highest of RSS samples taken every 10 ms on a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.growth_mib = 0.0

    def __enter__(self) -> PeakRss:
        self.base = status_kib(self.pid, "VmRSS")
        self.hwm = reset_peak(self.pid) and status_kib(self.pid, "VmHWM") <= self.base + 1024
        self._stop = threading.Event()
        self._max = self.base
        if not self.hwm:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self._max = max(self._max, status_kib(self.pid, "VmRSS"))
            except (OSError, KeyError):
                return
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.hwm:
            peak = status_kib(self.pid, "VmHWM")
        else:
            self._thread.join()
            peak = self._max
        self.growth_mib = (peak - self.base) / 1024


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
