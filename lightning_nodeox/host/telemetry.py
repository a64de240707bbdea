"""Ships a host's phase records to the coordinator in batches, off the critical path.

Training never waits on it: records go into a bounded queue that a daemon thread posts every
``interval`` seconds. A coordinator that cannot take them does not stop training; what could not be
sent is said once in the host's log (with how many records), never dropped silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from ..core.phases import PhaseRecord
from ..core.protocol import Reason, Refusal
from ..core.transport import Clock, HostClient

log = logging.getLogger(__name__)


class TelemetryShipper:
    """Batches records and posts them, mapped onto the coordinator's clock, to ``POST /v1/events``."""

    def __init__(self, client: HostClient, clock: Clock, *, interval: float = 1.0,
                 max_pending: int = 100_000, batch: int = 2000) -> None:
        self.client = client
        self.clock = clock
        self.interval = interval
        self.batch = batch
        self._pending: deque[PhaseRecord] = deque(maxlen=max_pending)
        self._overflowed = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failure: str | None = None
        self._shipping = threading.Lock()
        self.dropped = 0
        self.sent = 0
        self.busy_s = 0.0  # CPU time spent shipping (for overhead figures)
        self._thread = threading.Thread(target=self._run, name="nodeox-telemetry", daemon=True)
        self._thread.start()

    def __call__(self, record: PhaseRecord) -> None:
        if len(self._pending) == self._pending.maxlen:
            self._overflowed += 1
        self._pending.append(record)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            self._ship()

    def _ship(self) -> None:
        """Post what is pending; what the coordinator cannot take now stays queued."""
        with self._shipping:
            start = time.thread_time()
            try:
                self._ship_pending()
            finally:
                self.busy_s += time.thread_time() - start

    def _ship_pending(self) -> None:
        while self._pending:
            batch = [self._pending[i] for i in range(min(self.batch, len(self._pending)))]
            offset = self.clock.offset
            payload = []
            for r in batch:
                d = r.to_json()
                d["start"], d["end"] = r.start + offset, r.end + offset
                d["clock_offset"] = offset
                payload.append(d)
            sent_as = self.client.credential
            try:
                self.client.post_events(payload)
            except Refusal as e:
                self._failure = f"{type(e).__name__}: {e}"
                if e.reason is Reason.RATE_LIMITED:  # over the coordinator's budget: the batch waits its turn
                    return
                if e.reason is Reason.FORBIDDEN and self.client.credential != sent_as:
                    return  # the host joined again meanwhile: the batch goes again with its new credential
                self.dropped += len(batch)  # refused for good (4xx): a retry would be refused again
            except Exception as e:  # noqa: BLE001 - telemetry must never stop training
                self._failure = f"{type(e).__name__}: {e}"
                return
            else:
                self.sent += len(batch)
            for _ in batch:
                self._pending.popleft()

    def close(self, timeout: float = 10.0) -> int:
        """Send what is left (within ``timeout``); returns how many records could not be sent."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._pending and not self._thread.is_alive():  # records added after the thread's last batch
            self._ship()
        unsent = len(self._pending) + self._overflowed + self.dropped
        if unsent:
            log.warning("nodeox: %d phase records could not be sent to the coordinator at %s (%s); "
                        "they are missing from its events.jsonl but this host's TensorBoard logs have its phases",
                        unsent, self.client.url, self._failure or "queue overflow")
        return unsent
