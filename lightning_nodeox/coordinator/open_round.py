"""The open round as its close rule sees it (:class:`~lightning_nodeox.coordinator.quorum.OpenRound`): its
deltas, the hosts it waits for, and what it says of how it merged."""

from __future__ import annotations

from .deltas import RoundDeltas
from .runstate import RunState


class OpenRound:
    """The open round over ``state`` and its ``deltas``."""

    def __init__(self, state: RunState, deltas: RoundDeltas) -> None:
        self.state = state
        self.deltas = deltas

    def count(self) -> int:
        return len(self.deltas.by_host)

    def starts(self) -> dict[str, float]:
        return {h: d.start for h, d in self.deltas.by_host.items() if d.samples > 0}

    def in_run(self) -> int:
        return self.state.hosts.in_run(self.deltas.by_host)

    def needed(self) -> int:
        """The fewest deltas this round closes with: --min-hosts, lowered to the hosts still in the run."""
        return max(1, min(self.state.config.quorum, self.in_run()))

    def joins_awaited(self) -> int:
        """How many more hosts the open round waits to join: round 0 waits for ``--hosts``, later rounds for none."""
        state = self.state
        return max(state.config.hosts - len(state.hosts), 0) if state.round == 0 else 0

    def missing(self) -> list[str]:
        """The hosts whose delta the open round still waits for (live ones that have not sent), sorted."""
        sent = self.deltas.by_host  # (once: the round's close checks this after every piece taken)
        return sorted(h.id for h in self.state.hosts.expected(sent) if h.id not in sent)

    @property
    def opened(self) -> float:
        return self.state.round_opened

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def final(self) -> bool:
        return self.deltas.final

    @property
    def timeout(self) -> float | None:
        return self.state.config.round_timeout

    def merged(self, quorum: int, missing: list[str]) -> dict:
        """What the round's aggregate record says of how it merged (``--merge async``): its ``quorum``, the hosts
        it closed without (``late``), and the late deltas it took (``stale``: host -> rounds late)."""
        stale = {h: self.state.round - d.base_round for h, d in self.deltas.by_host.items()
                 if d.base_round < self.state.round}
        return {"quorum": quorum, "late": missing, "stale": stale}
