"""Trouble: a sink that cannot write (a full or unwritable disk) said once, then at most every minute, and when it
writes again; never once per failed write. The coordinator's events log, TensorBoard files and saved state use
it, and a host's TensorBoard loggers."""

from __future__ import annotations

import logging
import time

from .logs import Named

log = logging.getLogger(__name__)


class Trouble:
    """A sink that cannot write: said once, then at most every ``REPORT_EVERY`` seconds, and when it recovers.
    ``counts``: the sink loses records while it fails (and says how many); else it only falls behind. ``name``:
    what its lines start with (a coordinator's run, ``NodeoxStrategy``); ``meanwhile``: what happens until it writes
    again."""

    REPORT_EVERY = 60.0

    def __init__(self, what: str, name: str, *, counts: bool = True,
                 meanwhile: str = "the run goes on, writing is tried again") -> None:
        self.what = what
        self.meanwhile = meanwhile
        self.log = Named(log, name)
        self.counts = counts
        self.failing_since: float | None = None
        self._reported = 0.0
        self.lost = 0

    def failed(self, error: Exception, lost: int = 0) -> None:
        now = time.monotonic()
        self.lost += lost
        if self.failing_since is None:
            self.failing_since, self._reported = now, now
            self.log.error("cannot write %s (%s); %s", self.what, error, self.meanwhile)
        elif now - self._reported >= self.REPORT_EVERY:
            self._reported = now
            self.log.error("%s still cannot be written after %.0f s (%s)%s", self.what,
                           now - self.failing_since, error, f"; {self.lost} records lost so far" if self.counts else "")

    def ok(self) -> None:
        if self.failing_since is not None:
            self.log.warning("writing %s again after %.0f s%s", self.what,
                             time.monotonic() - self.failing_since,
                             f" ({self.lost} records lost meanwhile)" if self.counts else "")
            self.failing_since, self.lost = None, 0
