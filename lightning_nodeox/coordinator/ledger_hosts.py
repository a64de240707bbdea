"""What the data ledger (:mod:`~lightning_nodeox.coordinator.ledger`) keeps of each host, and what a publish
tells: a host's counts over the run, its slot, lease generation, units held and undecided reports."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..core.ledger_terms import Span

FREE = -1  # a unit's holder when none holds it

@dataclass
class HostCounts:
    """One host's samples over the run: leased, committed, returned (given back uncommitted)."""

    leased: int = 0
    committed: int = 0
    returned: int = 0

    @property
    def in_flight(self) -> int:
        return self.leased - self.committed - self.returned


@dataclass
class HostEntry:
    slot: int
    generation: int = 0
    present: bool = True
    held: int = 0  # units held now
    pending: deque[tuple[int, tuple[Span, ...]]] = field(default_factory=deque)  # (delta, spans) not yet decided
    counts: HostCounts = field(default_factory=HostCounts)

    def status(self) -> dict:
        c = self.counts
        return {"present": self.present, "generation": self.generation, "units_held": self.held,
                "leased": c.leased, "committed": c.committed, "in_flight": c.in_flight, "returned": c.returned,
                "undecided_deltas": len(self.pending)}


@dataclass(frozen=True)
class Published:
    """What a publish committed: ``samples``; ``spans``, one per unit it moved, in unit order (a relay reports
    them upstream as its own delta's :class:`Covered`); ``epoch_ended``: the epoch it ended, or None."""

    samples: int
    spans: tuple[Span, ...]
    epoch_ended: int | None
