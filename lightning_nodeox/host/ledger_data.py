"""A host's train loader under the coordinator's data ledger (NodeoxStrategy): the loader gets a
:class:`~lightning_nodeox.host.ledger_sampler.LedgerSampler`, as DDP's gets a ``DistributedSampler``.

- When: ``Trainer(use_distributed_sampler=True)`` (Lightning's default), one train loader (a ``DataLoader``) of a
  map-style dataset (it has a length) whose sampler is not a ``DistributedSampler`` already; a
  :class:`~lightning_nodeox.host.ledger_shards.LedgerShards` is shared out by shards (``host/ledger_shards.py``).
  Else nothing changes: another iterable dataset, ``use_distributed_sampler=False`` and several train loaders (a ``CombinedLoader``) keep
  today's loaders.
- A host of several devices (K ranks): every rank's loader gets the sampler, rank r of K (in place of the
  ``DistributedSampler`` Lightning gave it); rank 0 leases, and the other ranks take its answer
  (:meth:`~lightning_nodeox.host.ranks.HostRanks.lead`): every rank asks at the same row of its stream, so the
  ranks meet in that broadcast in the same order, and all end a pass on the same batch.
- Join: the host declares ``DataSpec(samples=len(dataset), seed=<seed_everything's, else 0>, shuffle=<whether the
  user's loader shuffled>)`` (:func:`declared`); every host of a run must declare the same.
- The loader: Lightning rebuilds it with the sampler (``_update_dataloader``: its batch size, workers, collate_fn
  and drop_last kept); the sampler leases one unit at a time through the link's round, rank 0 for the host's ranks
  (a coordinator that restarted is joined again first, :meth:`~lightning_nodeox.host.joining.Joining.lease`).
- Each round boundary: the delta carries ``sampler.take_covered(trained)``, ``trained`` the samples this pass's
  training steps consumed; at a pass's last batch (Lightning's epoch end) the round closes whether due or not,
  with ``pass_ended=True`` (a pass ends when the ledger has nothing more for the host: the others wait for its delta).
- A round whose delta was not taken (``RoundResult.lease_void``): ``sampler.void()``; the next lease is fresh. A
  batch the loader read ahead under the void lease (Lightning fetches one batch ahead) is not trained: its training
  step is skipped (:meth:`LedgerData.batch`), else it would be in the next round's delta while its units are
  another host's.
- A pass that finds nothing to read (the epoch's last units are the other hosts'): the sampler's ``pause`` is the
  session's :meth:`~lightning_nodeox.host.session.HostSession.idle_round`: the host sends the round the others
  wait for (an empty delta) and asks again once it closed; every round needs every host's delta, so a host that
  only slept would hold the others' round, and they the epoch's end, forever.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from lightning.fabric.utilities.data import has_iterable_dataset
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler

from ..core.ledger_order import DataOrder
from ..core.ledger_terms import Covered, LeaseReply
from ..core.protocol import DataSpec
from .ledger_sampler import LedgerSampler
from .session import HostSession


def shares_out(loader: object) -> bool:
    """Whether the ledger shares out this train loader's data (see the module's doc)."""
    return (isinstance(loader, DataLoader) and not has_iterable_dataset(loader)
            and hasattr(loader.dataset, "__len__") and not isinstance(loader.sampler, DistributedSampler))


def declared(samples: int, shuffle: bool) -> DataSpec:
    """What a host declares at join: its data's length, the run's seed (``seed_everything``'s, else 0), whether it
    shuffles."""
    return DataSpec(samples=samples, seed=int(os.environ.get("PL_GLOBAL_SEED", 0)), shuffle=shuffle)


def lease_for_ranks(session: HostSession, epoch: int | None) -> LeaseReply:
    """One unit for the host: rank 0 asks the coordinator, every rank returns its answer (a host of one device: rank
    0 alone)."""
    return session.ranks.lead(lambda: session.link.lease(epoch, 1), model=False)


class LedgerData:
    """The host's train data under the ledger: the declared spec, the sampler, and this pass's trained samples."""

    def __init__(self, spec: DataSpec, lease: Callable[[int | None], LeaseReply], idle: Callable[[], bool], *,
                 rank: int = 0, ranks: int = 1) -> None:
        self.spec = spec
        self.sampler = LedgerSampler(lease, DataOrder(spec.samples, spec.seed, spec.shuffle), rank=rank, ranks=ranks,
                                     pause=idle)
        self.trained = 0  # samples of this pass the training steps consumed
        self._pass = -1  # Lightning's epoch the count belongs to

    @classmethod
    def of(cls, loader: object, trainer: Trainer, session: HostSession,
           step: Callable[[], int]) -> LedgerData | None:
        """Before the join, on every rank: when the ledger shares out this fit's train ``loader`` (read early, only
        with ``use_distributed_sampler``), the session declares its data at join and sends what each round trained;
        the host's ranks read the lease in rows (this rank: ``trainer.global_rank`` of ``trainer.world_size``).
        ``step()``: where an idle round closes."""
        session.data, session.covered = None, lambda pass_ended: None
        if not shares_out(loader):
            return None
        return cls(declared(len(loader.dataset), _is_dataloader_shuffled(loader)),
                   lambda epoch: lease_for_ranks(session, epoch), lambda: session.idle_round(step()),
                   rank=trainer.global_rank, ranks=trainer.world_size).attached(session)

    def attached(self, session: HostSession) -> LedgerData:
        """This data is what ``session`` declares at join and reports at each round boundary."""
        session.data, session.covered = self.spec, self.covered
        return self

    def loader(self, loader: DataLoader) -> DataLoader:
        """``loader`` rebuilt with the ledger's sampler, as Lightning rebuilds one with a ``DistributedSampler`` (on a
        host of several devices, in place of the one it gave)."""
        return _update_dataloader(loader, self.sampler, mode=RunningStage.TRAINING)

    def batch(self, epoch: int, samples: int) -> bool:
        """A batch of ``samples`` of Lightning's epoch ``epoch`` is about to train: counted as consumed; whether it
        is trained (False: :meth:`read_under_void`)."""
        train = not self.read_under_void(epoch)
        self.consumed(epoch, samples)
        return train

    def consumed(self, epoch: int, samples: int) -> None:
        """A training step of Lightning's epoch ``epoch`` consumed ``samples`` samples."""
        if epoch != self._pass:
            self._pass, self.trained = epoch, 0
        self.trained += samples

    def read_under_void(self, epoch: int) -> bool:
        """Whether the batch about to train (of Lightning's epoch ``epoch``) was read under a lease found void since:
        the loader read it ahead, before the round boundary that voided it (or mid-batch, before a lease of a new
        generation). Its positions are another host's now, so it is not trained (the step is skipped)."""
        trained = self.trained if epoch == self._pass else 0
        return trained < self.sampler.void_rows

    def covered(self, pass_ended: bool) -> Covered | None:
        """What the round's delta trained (every rank, at the boundary); None when it trained no leased sample."""
        covered = self.sampler.take_covered(self.trained, pass_ended=pass_ended)
        return covered if covered.spans else None

    def void(self) -> None:
        """The round's delta was not taken: drop what the sampler holds; the next lease is fresh."""
        self.sampler.void()

