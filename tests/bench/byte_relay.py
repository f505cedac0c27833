"""The floor of a Python proxy on this event loop: a bare uvloop byte relay.

Each client connection is piped to a connection of its own to the upstream, bytes as they
come, both ways: no HTTP parsed, nothing measured, no task per request (one Python call a
read). What phasewatch costs beyond it is its own work, not the interpreter's or the event
loop's floor. Used by relay_bench.py (--byte-relay).

    python tests/bench/byte_relay.py PORT UPSTREAM_HOST:PORT
"""

from __future__ import annotations

import asyncio
import sys

try:
    import uvloop
except ImportError:  # the asyncio loop then: still the floor of that loop
    uvloop = None  # type: ignore[assignment]


class _Side(asyncio.Protocol):
    """One end of a pipe: what it reads is written to its peer's transport; when its peer
    cannot take more, it stops reading."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self.pending.append(data)  # the upstream connection is still being made

    def connection_lost(self, exc) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Client(_Side):
    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self.host, self.port = host, port

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        mine = self.transport
        assert mine is not None  # connection_made set it
        try:
            up_transport, up = await loop.create_connection(_Side, self.host, self.port)
        except OSError:
            mine.close()
            return
        up.peer, self.peer = self, up
        if mine.is_closing():  # the client left meanwhile
            up_transport.close()
            return
        for data in self.pending:
            up_transport.write(data)
        self.pending.clear()


async def serve(port: int, host: str, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, upstream_port), "127.0.0.1", port)
    await server.serve_forever()


def main() -> None:
    port, upstream = int(sys.argv[1]), sys.argv[2]
    host, _, upstream_port = upstream.rpartition(":")
    if uvloop is not None:
        uvloop.install()
    asyncio.run(serve(port, host, int(upstream_port)))


if __name__ == "__main__":
    main()
