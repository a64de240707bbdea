"""A host never waits silently: a wait that lasts says what it waits for, and says it again every
:data:`SAY_EVERY` seconds while it goes on (the model while another host provides it, a round's sync, values of
the other hosts, and a coordinator that does not answer, in host/client.py's retries)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

SAY_EVERY = 30.0  # seconds between two lines of one wait (the first comes after as long)


class WaitLine:
    """One wait for ``what`` (a phrase: ``host a waits for round 3's sync``): :meth:`still` says it, with how
    long it has lasted, once ``every`` seconds have passed since the wait began or was last said."""

    def __init__(self, what: str, every: float | None = None) -> None:
        self.what = what
        self.every = SAY_EVERY if every is None else every
        self.began = self._said = time.monotonic()

    def still(self, why: str) -> bool:
        """The wait goes on (``why``: what holds it); returns whether a line was said now."""
        now = time.monotonic()
        if now - self._said < self.every:
            return False
        self._said = now
        log.info("nodeox: %s (%.0f s so far): %s", self.what, now - self.began, why)
        return True
