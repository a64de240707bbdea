"""A Fabric host's train loader under the coordinator's data ledger (NodeoxFabricStrategy): what
:mod:`~lightning_nodeox.host.ledger_data` does for the Trainer, where Fabric has no fit loop.

- Which loader: ``fabric.setup_dataloaders(loader)`` with ``use_distributed_sampler=True`` (Fabric's default) gives
  a map-style loader a ``DistributedSampler`` of this host's one replica (the strategy's
  ``distributed_sampler_kwargs``); the first such loader that shuffles is the train loader, and the ledger's sampler
  takes that one's place. Fabric cannot tell a train loader from an evaluation one, so a loader that does not
  shuffle keeps its order (each host reads all of it, as before: an evaluation loader), and a second shuffled one
  is refused, naming ``use_distributed_sampler=False``. A loader with a sampler of its own, an iterable dataset or
  ``use_distributed_sampler=False`` keeps its loader as given.
- Join: the host declares ``DataSpec(len(dataset), PL_GLOBAL_SEED or 0, True)``; the loader must be set up before
  the host joins. The host joins at its first lease (the loop's first read) or its first optimizer step, whichever
  comes first: so weights loaded before the loop starts are in place.
- Trained: the batches the loader handed to the loop this pass (a batch the loop took is trained by the step that
  follows it). Each round boundary (an optimizer step) sends ``take_covered`` of that count.
- A pass's end: when the loader's iteration runs out (the ledger has nothing more for the host), before the loop
  sees the end, the strategy closes a round whether due or not (``pass_ended``): the user's loop does nothing
  special at a pass's end. A loop that leaves a pass early (``break``) reports at its next boundaries what it
  trained; what the pass read but did not train is read again by the next pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader, DistributedSampler

from ..core.ledger_terms import LeaseReply
from .ledger_data import LedgerData, declared


def fabric_sampled(loader: object) -> bool:
    """Whether Fabric's ``setup_dataloaders(use_distributed_sampler=True)`` gave ``loader`` its DistributedSampler of
    one replica over the dataset (not a wrapper of a sampler of the user's)."""
    return (isinstance(loader, DataLoader) and type(loader.sampler) is DistributedSampler
            and loader.sampler.num_replicas == 1 and hasattr(loader.dataset, "__len__"))


class PassReader:
    """The loop's iterator of one pass of the ledger's loader: counts the samples of each batch it hands over, and
    says when the pass ended (before the loop sees the end)."""

    def __init__(self, batches: Iterator, took: Callable[[int], None], ended: Callable[[], None]) -> None:
        self.batches, self.took, self.ended = batches, took, ended

    def __iter__(self) -> PassReader:
        return self

    def __next__(self):
        try:
            batch = next(self.batches)
        except StopIteration:
            self.ended()
            raise
        self.took(_samples(batch))
        return batch


def ledger_loader_class(cls: type[DataLoader]) -> type[DataLoader]:
    """A subclass of the train loader's class whose iterations are :class:`PassReader`s (``_ledger_pass``)."""

    def __iter__(self) -> PassReader:
        return self._ledger_pass(cls.__iter__(self))

    return type(f"Ledger{cls.__name__}", (cls,), {"__iter__": __iter__, "__module__": __name__})


class FabricData:
    """The host's train data under the ledger under Fabric: the declared spec, the sampler, the loader's passes."""

    def __init__(self, loader: DataLoader, lease: Callable[[int | None], LeaseReply], idle: Callable[[], bool],
                 pass_ended: Callable[[], None]) -> None:
        self.data = LedgerData(declared(len(loader.dataset), True), lease, idle)
        self.pass_ended = pass_ended
        self._passes = 0
        self.loader = self._counted(self.data.loader(loader))

    def _counted(self, loader: DataLoader) -> DataLoader:
        loader.__class__ = ledger_loader_class(type(loader))  # the loader as Fabric wraps it, but counted
        loader._ledger_pass = self._pass
        return loader

    def _pass(self, batches: Iterator) -> PassReader:
        self._passes += 1
        number = self._passes
        return PassReader(batches, lambda samples: self.data.consumed(number, samples), self.pass_ended)


def _samples(batch: object) -> int:
    try:
        return int(extract_batch_size(batch))
    except Exception:  # noqa: BLE001 - an unusual batch counts as one sample
        return 1
