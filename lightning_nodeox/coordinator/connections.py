"""The coordinator's open connections and their limits, so that half-sent requests cannot exhaust its files.

A connection is *waiting* from its opening, and again from the end of each response, until its next request's
headers are in; it is *busy* while a request is handled (a body read, a long poll, a download). A connection
waiting longer than ``--idle-timeout`` is closed (a request sent a byte at a time, or an idle keep-alive).

At most ``--max-connections`` are open. A new connection beyond that closes the one that has waited longest (a
real host sends its headers at once, so it is never that one); only when every connection is busy is the new
one refused. So a flood of half-sent requests from any number of addresses never locks out a host's join or
heartbeat, and hosts behind one NAT address are not limited as a group. The default limit is sized from the
open-file limit, which the coordinator raises to its hard limit at start (:func:`raise_open_file_limit`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Protocol

from ..core.logs import Named
from .config import NAME

log = logging.getLogger(__name__)

# files kept free of connections: the run's own (state, logs, a TensorBoard file per host, the lock, stdio) and the
# connections accepted at once before they are counted here (the server's backlog, 128)
RESERVED_FILES = 256
MAX_DEFAULT = 16384  # the default limit's ceiling (about 4,000 hosts' connections)
SWEEP_EVERY = 0.5  # seconds between closing the connections that waited too long


class Closable(Protocol):
    def force_close(self) -> None: ...


def raise_open_file_limit(name: str = NAME) -> int:
    """Raise this process's soft limit of open files to its hard limit; returns the soft limit now in force.
    ``name``: what a line saying it could not starts with (its run's)."""
    try:
        import resource
    except ImportError:  # not a POSIX system: the limit is what it is
        return 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:  # e.g. an unlimited hard limit above the kernel's own ceiling
            Named(log, name).warning("cannot raise the open-file limit from %d to %d (%s)", soft, hard, e)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_limit(open_files: int) -> int:
    """The default ``--max-connections`` for a process that may open ``open_files`` files."""
    return min(MAX_DEFAULT, max(open_files - RESERVED_FILES, open_files // 2))


class Connections:
    """The open connections (any objects with ``force_close()``), at most ``limit``, none waiting longer than
    ``idle_timeout`` seconds for its next request."""

    def __init__(self, limit: int, idle_timeout: float, clock=time.monotonic) -> None:
        self.limit = limit
        self.idle_timeout = idle_timeout
        self.clock = clock
        self._waiting: OrderedDict[Closable, float] = OrderedDict()  # since when, longest waiting first
        self._busy: set[Closable] = set()
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0

    def __len__(self) -> int:
        return len(self._waiting) + len(self._busy)

    def opened(self, conn: Closable) -> bool:
        """Admit a new connection (closing the longest-waiting one when at the limit); False: refused, for
        every open connection is busy."""
        if len(self) >= self.limit:
            if not self._waiting:
                self.refused += 1
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self.evicted += 1
            oldest.force_close()
        self._waiting[conn] = self.clock()
        return True

    def closed(self, conn: Closable) -> None:
        self._waiting.pop(conn, None)
        self._busy.discard(conn)

    def busy(self, conn: Closable) -> None:
        """A request's headers arrived on ``conn``."""
        if self._waiting.pop(conn, None) is not None:
            self._busy.add(conn)

    def idle(self, conn: Closable) -> None:
        """``conn``'s response has been sent: it waits for its next request."""
        if conn in self._busy:
            self._busy.discard(conn)
            self._waiting[conn] = self.clock()

    def sweep(self) -> int:
        """Close the connections that waited longer than ``idle_timeout``; returns how many."""
        deadline = self.clock() - self.idle_timeout
        late = []
        for conn, since in self._waiting.items():
            if since > deadline:
                break
            late.append(conn)
        for conn in late:
            del self._waiting[conn]
            conn.force_close()
        self.timed_out += len(late)
        return len(late)

    async def sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(SWEEP_EVERY, self.idle_timeout / 4))
            self.sweep()

    def status(self) -> dict:
        return {"open": len(self), "busy": len(self._busy), "limit": self.limit, "idle_timeout": self.idle_timeout,
                "evicted": self.evicted, "refused": self.refused, "timed_out": self.timed_out}
