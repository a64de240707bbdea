"""benchmarks/relay.py: bytes pass through unchanged and in order, and the relay stops cleanly."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from relay import Link, Relay

LINK = Link(delay=0.005, rate=400e6)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def round_trip(port: int, payload: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for i in range(0, len(payload), 100_003):  # odd-sized writes, to be re-chunked on the way
        writer.write(payload[i : i + 100_003])
        await writer.drain()
    writer.write_eof()
    back = await reader.read()  # to the end of stream: the echo server closes after our half close
    writer.close()
    return back


def test_bytes_pass_through_unchanged_and_in_order() -> None:
    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        async with Relay("127.0.0.1", server.sockets[0].getsockname()[1], up=LINK, down=LINK) as relay:
            port = relay.server.sockets[0].getsockname()[1]
            payloads = [os.urandom(1_500_000 + k) for k in range(3)]
            backs = await asyncio.wait_for(asyncio.gather(*(round_trip(port, p) for p in payloads)), 20)
            assert backs == payloads
            assert await asyncio.wait_for(round_trip(port, b""), 5) == b""
            total = sum(len(p) for p in payloads)  # counted once per direction, over every connection
            assert relay.up.sent == relay.down.sent == total
            assert relay.up.timeline[-1][1] == total
            assert all(a <= b for a, b in zip(relay.up.timeline, relay.up.timeline[1:]))
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_close_ends_open_connections_and_stops_listening() -> None:
    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        relay = Relay("127.0.0.1", server.sockets[0].getsockname()[1], up=LINK, down=LINK)
        port = await relay.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
        await asyncio.wait_for(relay.close(), 5)  # with the connection still open
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert not relay.connections
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
