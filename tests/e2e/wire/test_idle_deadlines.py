"""The server's deadlines on a connection between requests: the keep-alive timeout and
the header deadline, each armed only when it has something to guard (proxy.runtime.
protocol makes one timer serve many answers), still closing what they must close.

Raw sockets against a real server: a connection left idle is closed, one used again
before its deadline is not, and a head begun in the read that ended another request
still gets its 408.
"""

from __future__ import annotations

import socket
import time

import pytest

from ...support.fake_engine import FakeEngine
from ...support.hostile import connect, read_all, read_response
from ...support.servers import start_proxy, wait_for

MODEL = "m"
HEALTH = b"GET /phasewatch/health HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture
def proxy():
    engine = FakeEngine(models=[MODEL]).start()
    p = start_proxy(f"e={engine.url}", args=["--header-timeout", "1", "--engine", "e=openai"])
    yield p
    p.stop()
    engine.stop()


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` (it sent nothing: its end reads as EOF)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def test_an_idle_connection_is_closed_and_one_in_use_is_not(proxy):
    """uvicorn's keep-alive timeout (5 s): a connection left idle after an answer is
    closed; one that sends a request every half second stays open well past the
    deadline its first answer set, and is closed once it goes idle in turn."""
    idle, busy = connect(proxy.url, timeout=30), connect(proxy.url, timeout=30)
    try:
        for s in (idle, busy):
            s.sendall(HEALTH)
            assert read_response(s).startswith(b"HTTP/1.1 200 ")
        served = 0
        while not closed_by_server(idle):  # the idle one's deadline, while busy works
            busy.sendall(HEALTH)
            assert read_response(busy).startswith(b"HTTP/1.1 200 "), f"after {served}"
            served += 1
            time.sleep(0.5)
            assert served < 120, "the idle connection was never closed"
        # busy answered requests on one connection across the idle one's whole deadline
        assert served >= 2
        for _ in range(4):  # and goes on past the deadline its own first answer set
            busy.sendall(HEALTH)
            assert read_response(busy).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.5)
        wait_for(lambda: closed_by_server(busy), timeout=30)
    finally:
        idle.close()
        busy.close()


def test_a_head_begun_in_the_read_that_ended_a_request_gets_its_408(proxy):
    """One read holds a whole request and the start of the next head: the first is
    answered, and the deadline guards the second from that read on."""
    s = connect(proxy.url, timeout=30)
    try:
        s.sendall(HEALTH + b"GET /phasewatch/health HTTP/1.1\r\nho")
        got = read_all(s)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 200 ")
    second = got[got.index(b"HTTP/1.1", 8) :]
    assert second.startswith(b"HTTP/1.1 408 ")
    assert b"request head not complete within 1s" in second


def test_a_head_sent_whole_after_an_idle_pause_is_answered(proxy):
    """A head that comes whole in one read needs no deadline (none is armed): it is
    answered however long the connection was quiet before it, within keep-alive. (Before
    its first request a connection has the header deadline to send one.)"""
    s = connect(proxy.url, timeout=30)
    try:
        for i in range(4):
            if i:
                time.sleep(1.5)  # longer than --header-timeout, shorter than keep-alive
            s.sendall(HEALTH)
            assert read_response(s).startswith(b"HTTP/1.1 200 "), f"request {i}"
    finally:
        s.close()
