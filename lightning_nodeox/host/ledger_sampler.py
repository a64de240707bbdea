"""A host's sampler under the coordinator's data ledger: it yields the sample indices of the spans leased to the
host, leasing more as it runs out, and says which positions a round's delta trained.

The host's *stream* is its leased spans in the order leased. A host of ``ranks`` ranks reads it in *rows* of
``ranks`` positions: rank ``r`` takes the row's ``r``-th, so every rank yields one sample per row, all ranks ask for
a lease at the same row (each rank's source must answer alike: rank 0 asks the coordinator and gives the answer to
the others), and after ``c`` rows trained the host has trained the stream's next ``ranks * c`` positions.

A pass (one ``iter()``, Lightning's epoch) ends when the ledger has nothing for the host:

- :class:`EpochEnd`: the ledger's epoch is over (every position committed); the sampler moves to the ledger's
  epoch. A pass that has yielded nothing yet reads on in it (the pass before ended at the epoch's tail, on a
  Wait), so Lightning sees no empty epoch; one that has (its lease went void unseen) ends.
- :class:`Wait`: the epoch's last units are held by other hosts. If this pass yielded something, or the host
  holds positions it has not reported, the pass ends now: the host must then end its round (send its delta), or
  the round the others wait for could never close. Else the sampler waits (``pause``) and asks again: the host
  holds nothing undecided, and the others' rounds close without it.

A last row shorter than ``ranks`` (the pass's end) is dropped (``drop_last=True``) or filled by repeating its own
samples, as :class:`~torch.utils.data.DistributedSampler` does; either way its positions count as read.

What a delta carries (:meth:`LedgerSampler.take_covered`): yielded is not trained (a DataLoader prefetches), so
the strategy says how far training got: ``trained``, the samples of this pass its training steps consumed on this
rank (one per row); at the end of a pass (the loop ran out of data), ``pass_ended=True`` counts everything the
pass read, a last partial batch a DataLoader dropped included, as a DistributedSampler's epoch does. The strategy
reports at each pass's end (Lightning's epoch end): what a pass read but did not report (a pass cut short, as by
``limit_train_batches``, its prefetched batches never trained) is read again by the next pass. A lease of a
newer generation (after :class:`LeaseVoid`, or from a coordinator that restarted: a restored ledger voids every
lease), :meth:`LedgerSampler.void` or an EpochEnd drops what the sampler holds: those positions are the ledger's
again. A new generation or an EpochEnd that finds positions read but not reported (they may be trained into the
round's delta already) makes the next report carry those under the void lease, so the coordinator refuses that
delta: its training never reaches the model (the round's work is lost, never counted twice).

It has no length: Lightning then runs each epoch until the sampler stops (a length would end it early)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import Sampler

from ..core.ledger_order import DataOrder, EpochOrder
from ..core.ledger_terms import Covered, EpochEnd, Lease, LeaseReply, Span, Wait

LeaseSource = Callable[[int | None], LeaseReply]


def rank_share(row_indices: np.ndarray, rank: int, ranks: int) -> np.ndarray:
    """Rank ``rank``'s samples of whole rows of ``ranks`` indices (its place in each row)."""
    return row_indices[rank::ranks]


class LedgerSampler(Sampler[int]):
    """Yields the indices of the spans the ledger leases to this host, one rank's share.

    Args:
        source: ``source(epoch)`` asks the ledger for units for this host (``epoch``: the ledger epoch the
            host is in, None before its first lease); the wiring binds the host and how many units a lease takes.
        order: the run's data order, the coordinator's.
        rank, ranks: this rank and the host's number of ranks.
        drop_last: drop a pass's last row when shorter than ``ranks`` (else repeat its samples to fill it).
        pause: called before asking again after a :class:`Wait` (default: sleep one second); a true answer ends
            the pass (the strategy's pause takes part in the round the other hosts wait for, and says whether the
            run completed).
        block: positions read from the order at once.
    """

    def __init__(self, source: LeaseSource, order: DataOrder, *, rank: int = 0, ranks: int = 1,
                 drop_last: bool = False, pause: Callable[[], bool | None] | None = None, block: int = 4096) -> None:
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not one of the host's {ranks} ranks")
        self.source, self.data, self.rank, self.ranks = source, order, rank, ranks
        self.drop_last, self.pause = drop_last, pause or (lambda: time.sleep(1.0))
        self.block = max(block, ranks)
        self.epoch: int | None = None  # the ledger's epoch this host reads
        self.generation: int | None = None
        self.pass_epoch = 0  # Lightning's, from set_epoch: the order follows the ledger's epoch instead
        self._order: EpochOrder | None = None
        self._spans: deque[Span] = deque()  # the stream not yet reported; its first starts at position _reported
        self._leased = self._yielded = self._reported = 0  # stream positions: all leased, read, reported
        self._anchor = (0, 0)  # (row of this pass, stream position): rows after it are read from there on
        self._rows = 0  # rows read this pass
        self._stale: Covered | None = None  # read, not reported, of a lease found void since: the next report

    def set_epoch(self, epoch: int) -> None:
        """Lightning's epoch (kept; the ledger decides the data's epoch)."""
        self.pass_epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self._rows = 0
        self._yielded = self._reported  # read but not reported: a pass cut short (prefetched, never trained)
        self._anchor = (0, self._yielded)
        while True:
            if not self._fill():
                yield from self._last_row()
                return
            rows = min((self._leased - self._yielded) // self.ranks, self.block // self.ranks)
            start = self._yielded
            mine = rank_share(self._indices(start, start + rows * self.ranks), self.rank, self.ranks)
            for i in range(rows):
                self._yielded, self._rows = start + (i + 1) * self.ranks, self._rows + 1
                yield int(mine[i])
                if self._yielded != start + (i + 1) * self.ranks:
                    break  # void while this block was read: read on from the new stream

    def _fill(self) -> bool:
        """Whether a whole row is there to read, leasing as needed; False: the pass ends."""
        while self._leased - self._yielded < self.ranks:
            reply = self.source(self.epoch)
            if isinstance(reply, Lease):
                self._take(reply)
            elif isinstance(reply, EpochEnd):
                self._lost()  # the epoch ended without what this host held: none of it is its own now
                self.epoch = reply.now
                if self._rows:
                    return False
            elif isinstance(reply, Wait):
                if self._rows or self._leased > self._reported:
                    return False  # end the pass, so that the host sends what it holds
                if self.pause():
                    return False  # the pause says the pass ends (the run completed meanwhile)
            else:
                raise TypeError(f"the ledger's source answered {reply!r}: expected a Lease, Wait or EpochEnd")
        return True

    def _last_row(self) -> Iterator[int]:
        left = self._leased - self._yielded
        if not left:
            return
        start = self._yielded
        self._yielded = self._leased
        if not self.drop_last:
            self._rows += 1
            yield int(self._indices(start, start + left)[self.rank % left])

    def _take(self, lease: Lease) -> None:
        if (lease.epoch, lease.generation) != (self.epoch, self.generation):
            self._lost()  # a new epoch, or a new lease after this one was void: what is held is not ours
        if self._order is None or self._order.epoch != lease.epoch:
            self._order = self.data.epoch(lease.epoch)
        self.epoch, self.generation = lease.epoch, lease.generation
        self._spans.extend(lease.spans)
        self._leased += sum(len(s) for s in lease.spans)

    def _lost(self) -> None:
        """What the sampler holds is void, and the coordinator said so only now (a lease of a new generation: it
        restarted, or cut this host off; an epoch that ended without it). Positions read since the last report may
        be trained into this round's delta already, and are another host's now: the next report carries them
        under the void lease, so the coordinator refuses that delta (``LEASE_VOID``) and their training never
        reaches the model."""
        if self._yielded > self._reported and self._stale is None:
            self._stale = Covered(self.epoch if self.epoch is not None else 0, self.generation or 0,
                                  self._pop(self._yielded))
        self.void()

    def void(self) -> None:
        """Drop every span held, read or not (the host's lease is void: :class:`LeaseVoid`)."""
        self._spans.clear()
        self._yielded = self._reported = self._leased
        self._anchor = (self._rows, self._leased)

    @property
    def rows(self) -> int:
        """The rows this pass has read (the last one yielded is row ``rows - 1``)."""
        return self._rows

    @property
    def void_rows(self) -> int:
        """The rows of this pass read before its lease was last found void (0: none): those not trained yet must
        not be (their positions are the ledger's again); one rank trains one sample a row."""
        return self._anchor[0]

    def take_covered(self, trained: int, *, pass_ended: bool = False) -> Covered:
        """The positions trained since the last call, for the round's delta: up to ``trained`` samples of this
        pass on this rank; with ``pass_ended``, all the pass read. Call it on every rank at the same point (each
        drops what it returns; they all return the same, rank 0's goes with the delta)."""
        row, position = self._anchor
        upto = self._yielded if pass_ended else min(self._yielded, position + self.ranks * max(trained - row, 0))
        spans = self._pop(max(upto, self._reported))
        stale, self._stale = self._stale, None
        if stale is not None:  # positions of a lease found void since (:meth:`_lost`): the whole delta is void
            return stale
        return Covered(self.epoch if self.epoch is not None else 0, self.generation or 0, spans)

    def _pop(self, upto: int) -> tuple[Span, ...]:
        out = []
        while self._reported < upto:
            head = self._spans[0]
            n = min(len(head), upto - self._reported)
            out.append(Span(head.unit, head.start, head.start + n))
            self._reported += n
            if n == len(head):
                self._spans.popleft()
            else:
                self._spans[0] = Span(head.unit, head.start + n, head.end)
        return tuple(out)

    def _indices(self, start: int, end: int) -> np.ndarray:
        """The sample indices of stream positions ``[start, end)`` (not yet reported)."""
        parts, at = [], self._reported
        for s in self._spans:
            lo, hi = max(start, at), min(end, at + len(s))
            if lo < hi:
                parts.append(self._order.indices(s.start + lo - at, s.start + hi - at))
            at += len(s)
            if at >= end:
                break
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
