"""A user-space TCP relay that puts an emulated network link between clients and one server (no netem needed).

``Relay(target_host, target_port, up, down)`` listens on 127.0.0.1, port 0 (``await relay.start()`` returns
the port), and forwards every connection it accepts to the target. Each direction behaves as one link,
shared by all connections through the relay (``up``: client to server, ``down``: server to client):

- rate: a token bucket of ``rate`` bits/s holding ``burst`` bytes (default 5 ms of traffic, at least one
  read; the event loop's timers are only good to about a millisecond). A chunk leaves once the bucket has
  paid for it, so the link serializes at ``rate`` whatever the number of connections.
- delay: a chunk is delivered ``delay`` seconds after it left, in order. The link is a pipe, not
  stop-and-wait: chunks follow each other while earlier ones are in flight, and nothing limits the bytes in
  flight (no TCP window, no slow start).
- a new connection costs one round trip (the TCP handshake) before its first byte is forwarded.

End of stream is forwarded (after the delay) as a half close; a reset on either side closes both.
Each direction counts the bytes it delivered (``relay.up.sent``, ``relay.down.sent``) and when (``.timeline``:
``(time.time(), bytes so far)`` after each chunk), so a benchmark can read what crossed the link per round.
``await relay.close()`` (or leaving ``async with relay``) stops listening and closes every connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass

READ_SIZE = 256 * 1024


@dataclass(frozen=True)
class Link:
    """One direction of an emulated link: one-way ``delay`` in seconds, ``rate`` in bits/s (None: as fast
    as the relay copies), ``burst`` in bytes (None: 5 ms of traffic, at least one read)."""

    delay: float = 0.0
    rate: float | None = None
    burst: int | None = None


def add_link_options(p: argparse.ArgumentParser) -> None:
    """The near and far links' options of the placement benchmarks (one-way delay, rate each way)."""
    p.add_argument("--far-delay-ms", type=float, default=30.0)
    p.add_argument("--far-mbit", type=float, default=200.0)
    p.add_argument("--near-delay-ms", type=float, default=1.0)
    p.add_argument("--near-mbit", type=float, default=10000.0)


def links_of(args: argparse.Namespace) -> dict[str, Link]:
    """``{"near": Link, "far": Link}`` from :func:`add_link_options`' options."""
    return {"near": Link(args.near_delay_ms / 1e3, args.near_mbit * 1e6),
            "far": Link(args.far_delay_ms / 1e3, args.far_mbit * 1e6)}


class TokenBucket:
    """``take(n)`` returns once ``n`` bytes have been paid for at ``rate`` bits/s; takes are served in order."""

    def __init__(self, rate: float, burst: int | None) -> None:
        self.bytes_per_s = rate / 8
        self.capacity = burst if burst is not None else max(READ_SIZE, int(self.bytes_per_s * 0.005))
        self.tokens = float(self.capacity)
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.bytes_per_s)
            self.stamp = now
            self.tokens -= n  # a debt is paid by sleeping; oversleeping refills the bucket (up to its capacity)
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.bytes_per_s)


class Direction:
    """The state of one direction of the link, shared by the relay's connections."""

    def __init__(self, link: Link) -> None:
        self.delay = link.delay
        self.bucket = TokenBucket(link.rate, link.burst) if link.rate else None
        self.sent = 0  # bytes delivered, over every connection
        self.timeline: list[tuple[float, int]] = []  # (time.time(), sent) after each delivered chunk

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy ``reader`` to ``writer`` through this link until end of stream (then half-close ``writer``)."""
        loop = asyncio.get_running_loop()
        in_flight: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await in_flight.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                self.sent += len(data)
                self.timeline.append((time.time(), self.sent))
                await writer.drain()

        delivering = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(READ_SIZE):
                if self.bucket is not None:
                    await self.bucket.take(len(data))
                in_flight.put_nowait((loop.time() + self.delay, data))
                if delivering.done():  # the receiving side failed: stop reading
                    break
            in_flight.put_nowait((loop.time() + self.delay, b""))
            await delivering
        finally:
            delivering.cancel()


class Relay:
    """Listens on 127.0.0.1 and forwards to ``target_host:target_port`` through an emulated link."""

    def __init__(self, target_host: str, target_port: int, up: Link, down: Link) -> None:
        self.target = (target_host, target_port)
        self.up, self.down = Direction(up), Direction(down)
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Start listening; returns the port."""
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._forward(client_reader, client_writer))
        self.connections.add(task)
        task.add_done_callback(self.connections.discard)

    async def _forward(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_writer: asyncio.StreamWriter | None = None
        try:
            await asyncio.sleep(self.up.delay + self.down.delay)  # the handshake's round trip
            server_reader, server_writer = await asyncio.open_connection(*self.target)
            pumps = [asyncio.ensure_future(self.up.pump(client_reader, server_writer)),
                     asyncio.ensure_future(self.down.pump(server_reader, client_writer))]
            try:
                await asyncio.gather(*pumps)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (ConnectionError, OSError):
            pass  # a reset or refused connection ends this connection only
        finally:
            for writer in (client_writer, server_writer):
                if writer is not None:
                    writer.close()
                    with contextlib.suppress(ConnectionError, OSError):
                        await writer.wait_closed()
