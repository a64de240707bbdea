"""Where a host stands in the run, shared by the parts of its round (:mod:`~lightning_nodeox.host.round`): the
model it holds (its round and hash), whether the run completed, whether training goes on while it waits; and the
words those parts share: where a sync or a fetched model goes (:class:`Into`), what a round gave
(:class:`RoundResult`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..core.logs import Named
from ..core.phases import PhaseLog
from ..core.transport import HostClient
from .tensors import HostTensors


class Into(enum.Enum):
    """Where a sync or a fetched model goes; the caller says, for each call."""

    LIVE = "live"  # the live model, and θ_r := it: training waits for the exchange
    BASE = "base"  # θ_r (``base``) only: training goes on in the live model, which folds it in (overlap)


@dataclass
class RoundResult:
    round: int  # the round that closed
    model_hash: str
    complete: bool  # the run has completed: no more rounds
    contributed: bool  # this host's delta was part of the round
    metrics: dict[str, list] = field(default_factory=dict)  # the sync's sync_dist values, reduced across hosts
    lease_void: bool = False  # a delta of the round was not taken: the host's data lease is void (lease again)


class Standing:
    """One host's standing: its tensors, its client and phase log, the round it is in and its model's hash."""

    def __init__(self, tensors: HostTensors, client: HostClient, phases: PhaseLog, log: Named) -> None:
        self.tensors = tensors
        self.client = client
        self.phases = phases
        self.log = log  # what its lines start with (a site relay's: its own name)
        self.round = 0
        self.model_hash = ""
        self.complete = False
        self.trains_on = False  # training goes on while the round overlapped is open (set by the training side)
        self.base_changed = False  # a sync whose download broke off is half applied: base is not model_hash's

    @property
    def host(self) -> str:
        return self.client.host

    def training(self, into: Into) -> bool:
        """Whether this host's training goes on while it waits for the round (overlapped, not yet waiting for its
        sync): told to the coordinator with each delta and sync poll, so that values wait for this host."""
        return into is Into.BASE and self.trains_on
