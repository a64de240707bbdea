"""The syncs of the last rounds, for hosts that are behind (``--merge async``): a host whose delta was merged
into a later round than its own applies the syncs it missed, in order, from here (or from the run's store), and
ends on the same model as every host. Each sync kept holds a read on its buffer, so the coordinator never writes
a later sync into it."""

from __future__ import annotations

from ..core.wire import Message
from .runstate import RunState


class SyncHistory:
    """The syncs of the last ``depth`` published rounds of ``state``'s model, by round (depth 0: none kept,
    ``--merge sync``)."""

    def __init__(self, depth: int, state: RunState) -> None:
        self.depth = depth
        self.state = state
        self._syncs: dict[int, Message] = {}

    def reading(self, sync: Message, delta: int) -> None:
        """A kept sync's buffer is held (+1) or let go (-1)."""
        if self.state.model is not None:
            self.state.model.reading(sync, delta)

    def add(self, sync: Message) -> None:
        """``sync`` was published; the syncs more than ``depth`` rounds before it are let go."""
        if self.depth <= 0:
            return
        round_ = sync.meta.round
        if round_ not in self._syncs:
            self.reading(sync, +1)
            self._syncs[round_] = sync
        for old in [r for r in self._syncs if r <= round_ - self.depth]:
            self.reading(self._syncs.pop(old), -1)

    def get(self, round_: int) -> Message | None:
        return self._syncs.get(round_)

    def base_hash(self, round_: int) -> str | None:
        """The hash of the model round ``round_`` started from, while its sync is kept."""
        sync = self._syncs.get(round_)
        return sync.meta.base_hash if sync is not None else None

    def clear(self) -> None:
        """Let every kept sync go (the model was replaced: they no longer lead to it)."""
        for sync in self._syncs.values():
            self.reading(sync, -1)
        self._syncs.clear()
