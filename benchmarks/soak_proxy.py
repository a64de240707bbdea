"""A TCP proxy the soak can cut: the link between a host (or a relay) and what it talks to.

``CutProxy(target_port)`` listens on 127.0.0.1 port 0 (``start()`` returns the port) on an event loop of its own
thread, and forwards every connection to ``127.0.0.1:target_port``. ``cut(seconds)`` resets every connection open
and, for ``seconds``, resets every new one as soon as it is accepted: to the host the link is down (connections
refused or dropped), as a cable pulled, while the processes on both sides go on. The target may restart on its
port meanwhile; the proxy connects afresh for each connection.

Why a proxy and not network namespaces: it needs no privileges or veth pairs, cuts one link of a run of many
processes on loopback, and is what the soak's test runs too.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time

READ_SIZE = 256 * 1024


class CutProxy:
    """Forwards 127.0.0.1:<its port> to 127.0.0.1:``target_port``; ``cut(seconds)`` takes the link down."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.down_until = 0.0  # time.monotonic() until which the link is down
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="soak-proxy", daemon=True)
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    def start(self) -> int:
        """Start listening; returns the port."""
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self.loop).result(10)
        return self.server.sockets[0].getsockname()[1]

    def cut(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones for ``seconds``."""
        self.down_until = time.monotonic() + seconds
        self.loop.call_soon_threadsafe(self._drop_all)

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self.down_until

    def close(self) -> None:
        """Stop listening, drop every connection and end the proxy's thread."""
        async def closing() -> None:
            assert self.server is not None
            self.server.close()
            self._drop_all()

        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(closing(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def _drop_all(self) -> None:
        for writer in list(self.writers):
            _reset(writer)
        self.writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            _reset(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            _reset(writer)
            return
        self.writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self.writers.discard(w)
                w.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream (then half-close) or a reset on either side (then close both)."""
    try:
        while data := await reader.read(READ_SIZE):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0), as a link that went down mid-stream looks to TCP."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
