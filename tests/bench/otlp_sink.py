"""A cheap OTLP/HTTP sink for the relay benchmark: answers every POST with an empty 200
(an empty protobuf is a valid Export*ServiceResponse), so ``phasewatch --otel`` exports
as it would to a collector, and the sink's own CPU is not the contender's.

    python tests/bench/otlp_sink.py PORT
"""

from __future__ import annotations

import asyncio
import sys

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n"


class Sink(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.buf = self.buf[end:]
            self.transport.write(_OK)


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Sink, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
