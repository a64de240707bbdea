"""Streaming data under the coordinator's data ledger: the ledger shares out *shards* (LitData chunks, WebDataset
tar files, any list of names), each read whole by one host.

The user wraps the shards in :class:`LedgerShards` (``LedgerShards(paths, read)``, ``read(path)`` yields a shard's
samples) and gives it to a ``DataLoader`` (``num_workers=0``). Under ``NodeoxStrategy`` with
``use_distributed_sampler=True`` (Lightning's default) the host declares ``DataSpec(samples=len(shards), seed,
shuffle=True)``: a ledger position is a shard, so the coordinator should lease small units (``--data-unit 1``: a
unit of N positions is N shards). The dataset reads the shards its :class:`LedgerSampler` yields (the ledger's order,
:class:`~lightning_nodeox.core.ledger_order.DataOrder`) and yields their samples in turn. Outside the ledger (no
NodeoxStrategy, ``use_distributed_sampler=False``) it reads every shard in order.

What a round reports: only shards whose samples the training steps consumed *completely*. A shard partly trained
at a round boundary is not reported; its remaining samples go into the next round's delta, which reports it. A
lease found void (the round's delta was not taken) abandons the shard being read at once: its remaining samples
are never read, and those the loader read ahead are not trained (as for map-style data, the step is skipped).

Refused: ``num_workers > 0`` (the shards are read in the training process, so that the host knows which shard each
sample is of) and a host of several devices (``Trainer(devices=1)`` per host)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from lightning.pytorch import Trainer
from torch.utils.data import DataLoader, IterableDataset

from ..core.ledger_terms import Covered
from .ledger_data import LedgerData, declared, lease_for_ranks
from .lightning_private import train_loader_early
from .session import HostSession


class LedgerShards(IterableDataset):
    """A dataset of ``shards`` read by ``read(shard)``: under the data ledger, the ledger leases it shards."""

    def __init__(self, shards: Sequence[str], read: Callable[[str], Iterable[Any]]) -> None:
        if not len(shards):
            raise ValueError("LedgerShards needs at least one shard")
        self.shards, self.read = list(shards), read
        self.data: ShardData | None = None  # set by the strategy under the ledger
        self.ends: list[int] = []  # samples yielded this pass at the end of each shard read (or abandoned)

    def __iter__(self) -> Iterator[Any]:
        self.ends = []
        if self.data is None:
            for shard in self.shards:
                yield from self.read(shard)
            return
        sampler, count = self.data.sampler, 0
        for position in sampler:
            row = sampler.rows - 1  # this shard's row of the pass
            for sample in self.read(self.shards[position]):
                if sampler.void_rows > row:
                    break  # the lease is void: the rest of this shard is another host's
                count += 1
                yield sample
            self.ends.append(count)

    def whole(self, samples: int) -> int:
        """How many of this pass's shards the first ``samples`` samples read completely."""
        return bisect.bisect_right(self.ends, samples)

    def samples_before(self, rows: int) -> float:
        """The samples of this pass's first ``rows`` shards (infinite while the last of them is being read)."""
        return 0 if rows == 0 else self.ends[rows - 1] if len(self.ends) >= rows else float("inf")


class ShardData(LedgerData):
    """:class:`LedgerData` for a :class:`LedgerShards` loader: the sampler's positions are shards."""

    dataset: LedgerShards | None = None

    @classmethod
    def of(cls, trainer: Trainer, session: HostSession, *, samplers: bool,
           step: Callable[[], int]) -> LedgerData | None:
        """The fit's data under the ledger (``samplers``: the Trainer's ``use_distributed_sampler``), its train loader
        read early once: a :class:`LedgerShards` loader's shards, else :meth:`LedgerData.of`."""
        loader = train_loader_early(trainer) if samplers else None
        if not isinstance(getattr(loader, "dataset", None), LedgerShards):
            return LedgerData.of(loader, trainer, session, step)
        if trainer.world_size > 1:
            raise ValueError(f"LedgerShards under the data ledger runs on a host of one device (this host has "
                             f"{trainer.world_size}): use Trainer(devices=1) per host")
        _check_workers(loader)
        return cls(declared(len(loader.dataset.shards), True), lambda epoch: lease_for_ranks(session, epoch),
                   lambda: session.idle_round(step())).attached(session)

    def loader(self, loader: DataLoader) -> DataLoader:
        """The loader as given; its dataset reads the shards this host's sampler yields."""
        if not isinstance(loader.dataset, LedgerShards):
            raise ValueError("the train loader under the data ledger changed kind: give fit one LedgerShards loader")
        _check_workers(loader)
        loader.dataset.data, self.dataset = self, loader.dataset
        return loader

    def read_under_void(self, epoch: int) -> bool:
        trained = self.trained if epoch == self._pass else 0
        return self.dataset is not None and trained < self.dataset.samples_before(self.sampler.void_rows)

    def covered(self, pass_ended: bool) -> Covered | None:
        """The shards this round trained completely (at a pass's end: every shard the pass read)."""
        shards = self.dataset.whole(self.trained) if self.dataset is not None else 0
        covered = self.sampler.take_covered(shards, pass_ended=pass_ended)
        return covered if covered.spans else None


def _check_workers(loader: DataLoader) -> None:
    if loader.num_workers:
        raise ValueError(f"a LedgerShards loader under the data ledger reads in the training process, not in "
                         f"{loader.num_workers} workers: use DataLoader(..., num_workers=0)")
