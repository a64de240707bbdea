"""Keeps a host's lease with the coordinator: a daemon thread says "alive" every few seconds.

The coordinator stops expecting a host it has not heard from within its lease (``nodeox coordinator --lease``),
so a round closes on what the live hosts sent; a heartbeat from a dropped host makes it expected again. The
thread beats four times per lease (at most every ``MAX_INTERVAL`` seconds), learning the lease from each
answer. It starts before the host joins and beats from the moment the join has answered (so a host providing
or fetching a large model at join keeps its lease), until the host leaves, independently of training and of the
exchange.
"""

from __future__ import annotations

import logging
import threading

from ..core.logs import Named
from ..core.transport import HostClient

log = logging.getLogger(__name__)

MAX_INTERVAL = 2.0
BEATS_PER_LEASE = 4


class Heartbeat:
    """Posts ``client.heartbeat()`` on a thread of its own until :meth:`stop`."""

    def __init__(self, client: HostClient, name: str = "nodeox") -> None:
        """``name``: what its lines start with (a site relay's: its own name)."""
        self.client = client
        self.log = Named(log, name)
        self.interval = MAX_INTERVAL
        self.beats = 0
        self._stop = threading.Event()
        self._failures = 0  # in a row
        self._thread = threading.Thread(target=self._run, name="nodeox-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.client.joined:  # nothing to keep before the join has answered
                self._stop.wait(0.1)
                continue
            try:
                lease = self.client.heartbeat()
            except Exception as e:  # noqa: BLE001 - the coordinator may be restarting; the next beat tries again
                self._failures += 1
                if self._failures == 2:  # one alone is a race: a beat sent with the credential a join replaced
                    self.log.info("host %s: heartbeat not answered (%s); still trying", self.client.host, e)
            else:
                self.beats += 1
                self._failures = 0
                self.interval = min(MAX_INTERVAL, lease / BEATS_PER_LEASE)
            self._stop.wait(self.interval)

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
