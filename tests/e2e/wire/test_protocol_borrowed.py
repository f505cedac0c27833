"""What proxy.runtime.protocol borrows from uvicorn's private protocol is still there.

The guarded protocol subclasses uvicorn's httptools protocol and reads and writes its
private state (see the module's docstring and ``BORROWED``). A uvicorn release that
renames any of it must fail here, by name, rather than silently unguard the wire.
"""

from __future__ import annotations

import asyncio

from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from proxy.runtime.borrowed import BORROWED
from proxy.runtime.protocol import guarded_protocol


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)


def test_the_borrowed_methods_exist():
    missing = [
        n
        for n in BORROWED["HttpToolsProtocol"]
        if not callable(getattr(HttpToolsProtocol, n, None))
    ]
    assert not missing, f"uvicorn's HttpToolsProtocol lost {missing}"


def test_the_borrowed_state_exists_on_a_live_connection():
    seen: list[dict] = []

    async def app(scope, receive, send):
        seen.append(scope)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> None:
        config = Config(
            app, lifespan="off", log_config=None, server_header=False, date_header=False
        )
        config.load()
        cls = guarded_protocol(4096, 5.0, lambda reason: None)
        proto = cls(config, ServerState(), {}, _loop=asyncio.get_running_loop())
        transport = _Transport()
        proto.connection_made(transport)
        missing = [n for n in BORROWED["protocol state"] if not hasattr(proto, n)]
        assert not missing, f"uvicorn's protocol state lost {missing}"
        assert isinstance(proto.flow, FlowControl)
        assert not [n for n in BORROWED["FlowControl"] if not hasattr(proto.flow, n)]
        proto.data_received(
            b"POST /x HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n"
            b"2\r\nhi\r\n0\r\nx-trailer: 1\r\n\r\n"
        )
        cycle = proto.cycle
        assert isinstance(cycle, RequestResponseCycle)
        missing = [n for n in BORROWED["RequestResponseCycle"] if not hasattr(cycle, n)]
        assert not missing, f"uvicorn's RequestResponseCycle lost {missing}"
        # the hang-up hook keeps the relay's callback on the cycle (runtime.direct)
        assert hasattr(cycle, "__dict__"), "uvicorn's RequestResponseCycle has no room left"
        for _ in range(100):  # bounded: the app's task runs on this loop
            if cycle.response_complete:
                break
            await asyncio.sleep(0.01)
        assert bytes(transport.out).startswith(b"HTTP/1.1 200 OK\r\n")
        # the guards ran inside uvicorn's handling: the trailer never became a header
        assert seen and (b"x-trailer", b"1") not in seen[0]["headers"]
        proto.connection_lost(None)

    asyncio.run(main())
