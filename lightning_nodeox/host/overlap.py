"""Overlap: a round's exchange in flight while training goes on, and the fold of its sync into the live model.

At a round boundary rank 0 sets the round's snapshot aside (:meth:`HostTensors.take_snapshot`; ``DELAYED``: the
live model goes back to θ_r) and hands the exchange to the worker; the sync goes into ``base`` only. When it has
arrived (checked at every step, decided by rank 0 for all ranks) or at the next boundary (training then waits for
it), the live model becomes θ_{r+1} plus the progress made since the snapshot, or just θ_{r+1} when the run
completed with that round (every host ends on the same model). The first and the last round are never
overlapped: the strategy decides which rounds are (:meth:`InFlight.overlaps`). While training goes on, the
exchange tells the coordinator so (:attr:`HostRound.trains_on`): values exchanged at an epoch's end then wait for
this host, until the training waits for the sync.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from ..core import phases as P
from ..core.ledger_terms import Covered
from .link import RunLink
from .ranks import HostRanks, OneRank
from .settings import Overlap
from .standing import RoundResult


class InFlight:
    """The overlapped round of one host, on every rank: whether its exchange is in flight (``pending``) and where
    it closed (``step``); rank 0 also holds its future."""

    def __init__(self, mode: Overlap, ranks: OneRank | HostRanks, link: RunLink | None) -> None:
        self.mode = mode
        self.ranks = ranks
        self.link = link  # rank 0's
        self.pending = False
        self.step = 0  # the global step where the round in flight closed (for its progress line)
        self._future: Future | None = None
        self._round = 0

    def overlaps(self, *, final: bool, closed_rounds: int) -> bool:
        """Whether the round closing now overlaps training: never the first one (the hosts' rounds start together
        after it, whatever their start-up took), nor the final one."""
        return self.mode is not Overlap.OFF and not final and closed_rounds > 0

    def arrived(self) -> bool:
        """Rank 0: whether the exchange in flight has finished."""
        return self._future is not None and self._future.done()

    def start(self, samples: int, step: int, *, begin: Callable[[], None],
              metrics: Callable[[], dict[str, list]], covered: Covered | None = None) -> None:
        """Every rank: the round of ``samples`` closed at ``step``; rank 0 runs ``begin`` (its training record), sets
        the snapshot aside and starts the exchange with the sync_dist values ``metrics()`` returns. Under
        ``DELAYED`` every rank then holds θ_r."""
        delayed = self.mode is Overlap.DELAYED

        def lead() -> None:
            begin()
            link = self.link
            link.round.tensors.take_snapshot(restart_from_base=delayed, round_=link.round.round)
            link.round.trains_on = True  # before the exchange starts: its delta already says so
            self._round = link.round.round
            self._future = link.submit(link.round.run_overlapped, samples, delayed, metrics(), covered)

        self.ranks.lead(lead, model=delayed)
        self.pending = True
        self.step = step

    def fold(self, *, wait: bool = False) -> RoundResult:
        """Every rank: fold the arrived sync into the live model (``wait``: training waits for it first); the other
        ranks take rank 0's folded model."""
        result = self.ranks.lead(lambda: self._fold_in(wait))
        self.pending = False
        return result

    def _fold_in(self, wait: bool) -> RoundResult:
        link = self.link
        link.round.trains_on = False  # from the exchange's next sync poll on, values no longer wait for this host
        if wait:
            with link.phases.timed(self._round, P.WAIT):
                link.wait(self._future)
        result = link.result(self._future)
        self._future = None
        with link.phases.timed(result.round, P.FOLD):
            if result.complete:
                link.round.tensors.restore_live()
            else:
                link.round.tensors.fold()
        return result
