"""The sync of the round that is closing, readable while it is made: its header at once, each piece once the
round's close has sealed it, the trailer (θ's new hash) last. A host waiting for the round downloads it as it
comes, so its download and apply overlap the coordinator's close, which overlaps the deltas still arriving.

Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..core.wire import Message


class SyncBroken(Exception):
    """The round's close failed while its sync was made: what was sent of it is not a whole sync."""


class SyncInMaking:
    """Round ``round_``'s sync while its pieces are made; ``complete``: the run completes with it."""

    def __init__(self, round_: int, sync: Message, complete: bool) -> None:
        self.round = round_
        self.sync = sync
        self.complete = complete
        self.ready = sync.layout.data_start  # bytes that may be sent
        self.failed = False
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self.sync)

    def sealed(self, q: int) -> None:
        """Piece ``q`` is sealed."""
        self._advance(self.sync.wire_end(q))

    def finished(self) -> None:
        """The trailer is written: the sync is whole."""
        self._advance(len(self.sync))

    def fail(self) -> None:
        self.failed = True
        self._advance(self.ready)

    def _advance(self, ready: int) -> None:
        self.ready = max(self.ready, ready)
        self._changed.set()
        self._changed = asyncio.Event()  # the next change wakes the readers again

    async def reach(self, end: int) -> None:
        """Return once the first ``end`` bytes may be sent; :class:`SyncBroken` if the close failed."""
        while True:
            if self.failed:
                raise SyncBroken(f"round {self.round}'s close failed while its sync was made")
            if self.ready >= end:
                return
            changed = self._changed
            await changed.wait()

    async def parts(self) -> AsyncIterator[memoryview]:
        """The sync's bytes in order, each part as soon as it may be sent; :class:`SyncBroken` if the close
        failed."""
        view, sent = self.sync.view(), 0
        while True:
            if self.failed:
                raise SyncBroken(f"round {self.round}'s close failed while its sync was sent")
            ready = self.ready
            if ready > sent:
                yield view[sent:ready]
                sent = ready
            if sent == len(view):
                return
            changed = self._changed
            if self.ready == sent and not self.failed:
                await changed.wait()
