"""What the coordinator lends to bodies it receives, whatever transport carries them: receive buffers reused across
rounds, one upload in flight per host, and a bound on the bodies read at once."""

from __future__ import annotations

import asyncio

import torch

from ..core.protocol import Reason, Refusal

MAX_UPLOADS = 8  # delta bodies read at once (each needs a receive buffer of the delta's size)


class ReceiveBuffers:
    """Byte buffers for incoming deltas, reused across rounds (at most ``keep`` idle ones are kept)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._idle: list[torch.Tensor] = []

    def get(self, size: int) -> torch.Tensor:
        while self._idle:
            buf = self._idle.pop()
            if buf.numel() == size:
                return buf
        return torch.empty(size, dtype=torch.uint8)

    def put(self, buf: torch.Tensor) -> None:
        if len(self._idle) < self.keep:
            self._idle.append(buf)


class Uploads:
    """Delta uploads in flight: one per host, ``limit`` bodies read at once (the others wait, unread)."""

    def __init__(self, limit: int = MAX_UPLOADS) -> None:
        self.hosts: set[str] = set()
        self.reading = asyncio.Semaphore(limit)

    def claim(self, host: str) -> None:
        if host in self.hosts:
            raise Refusal(Reason.BUSY, f"host {host} already has an upload in flight; try again when it has ended")
        self.hosts.add(host)

    def release(self, host: str) -> None:
        self.hosts.discard(host)
