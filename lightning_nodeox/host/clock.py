"""The coordinator-minus-host clock offset, from request round trips (the fastest recent trip wins)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class ClockSample:
    rtt: float
    offset: float  # coordinator clock - host clock


class ClockOffset:
    """Keeps the last ``keep`` samples; :attr:`offset` is that of the one with the shortest round trip."""

    def __init__(self, keep: int = 32) -> None:
        self._samples: list[ClockSample] = []
        self._keep = keep
        self._lock = threading.Lock()

    def add(self, sent: float, received: float, server_time: float) -> None:
        sample = ClockSample(received - sent, server_time - (sent + received) / 2)
        with self._lock:
            self._samples = [*self._samples[-(self._keep - 1):], sample]

    def best(self) -> ClockSample | None:
        with self._lock:
            return min(self._samples, key=lambda s: s.rtt) if self._samples else None

    @property
    def offset(self) -> float:
        best = self.best()
        return 0.0 if best is None else best.offset
