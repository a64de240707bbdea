"""The ranks of one host: a world of one, or the processes of a host of several devices (DDP inside the host): K on
one machine, or K on each of ``num_nodes`` machines (a host that spans machines is one DDP world all the same).

Rank 0 alone talks to the coordinator; the other ranks follow it at a few points that every rank reaches on the
same optimizer step (join, round boundary, fold, end of training), where :meth:`HostRanks.lead` runs rank 0's
work and then broadcasts its outcome (a small picklable value, or the error that stopped it) and the exchanged
tensors that work wrote in rank 0's live model (:meth:`HostTensors.take_changed
<lightning_nodeox.host.tensors.HostTensors.take_changed>`: a round's set as its sync applied it, the tensors an
overlap fold wrote; all of them after the join, a fetched model or the run's end). Each rank so holds rank 0's
model bit for bit, and no rank keeps a copy of the round's base or snapshot. Between those points DDP keeps the
ranks' parameters identical (they start from rank 0's at wrap time, and each step applies the same all-reduced
gradients), so a tensor rank 0 did not write, a frozen backbone above all, is not sent.

Decisions that only rank 0 can take (a time budget ran out, an overlapped sync has arrived) are broadcast at
every step (:meth:`HostRanks.decide`). Outcomes and decisions travel over a gloo group on the CPU, so a rank
waiting for rank 0's exchange does not hold a GPU stream; tensors travel over the host's default group (NCCL on
GPUs, gloo on the CPU).

All of a host's ranks carry its one id (:func:`check_one_host_id`): rank 0's is the host's at the coordinator,
and the machines of a host that spans machines must each be given it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment

T = TypeVar("T")

# Rank 0 may spend a whole exchange (waiting for the slowest host) between two messages to the other ranks. A rank
# that dies is noticed by what launched the ranks (Lightning, torchrun), which stops the others.
CONTROL_TIMEOUT = timedelta(days=1)


class OneRank:
    """A host of one device: rank 0 is the only rank; nothing is sent."""

    leader = True
    size = 1

    def decide(self, *flags: bool) -> tuple[bool, ...]:
        return flags

    def total(self, count: int) -> int:
        return count

    def lead(self, work: Callable[[], T], *, model: bool = True) -> T:
        return work()

    changed: Callable[[], tuple[int, ...]] | None = None  # unused: nothing to send

    def close(self) -> None:
        pass


class HostRanks:
    """The ranks of a host with several devices, in the host's process group (all of ``torch.distributed``'s
    default group: Lightning built it for this host alone)."""

    def __init__(self, tensors: list[torch.Tensor], *, per_step: bool) -> None:
        """``tensors``: this rank's exchanged tensors, in the same order on every rank. ``per_step``: rank 0 takes
        decisions at every step (overlap, a time budget), so :meth:`decide` broadcasts them."""
        self.tensors = tensors
        self.per_step = per_step
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.leader = self.rank == 0
        # rank 0: the indices of the tensors written since it was last called; set once joined (till then: all)
        self.changed: Callable[[], tuple[int, ...]] = lambda: tuple(range(len(self.tensors)))
        self._control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def decide(self, *flags: bool) -> tuple[bool, ...]:
        """Rank 0's ``flags`` on every rank."""
        if not self.per_step:
            return flags  # without overlap or a time budget every rank decides alike from its step count
        sent = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        dist.broadcast(sent, src=0, group=self._control)
        return tuple(bool(f) for f in sent.tolist())

    def total(self, count: int) -> int:
        """The sum of ``count`` over the host's ranks (samples trained in a round)."""
        summed = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(summed, group=self._control)
        return int(summed.item())

    def lead(self, work: Callable[[], T], *, model: bool = True) -> T:
        """Rank 0 runs ``work``; every rank returns its result, and (``model``) holds rank 0's tensors: those
        rank 0 wrote since the last such call (:attr:`changed`; their indices ride on the result). When ``work``
        fails, rank 0 raises its error and the other ranks a RuntimeError that names it."""
        if self.leader:
            try:
                value = work()
                changed = self.changed() if model else ()
            except BaseException as e:
                self._send(("failed", f"{type(e).__name__}: {e}", ()))
                raise
            self._send(("done", value, changed))
        else:
            kind, value, changed = self._receive()
            if kind == "failed":
                raise RuntimeError(f"rank 0 of this host stopped ({value}); rank {self.rank} stops with it")
        if model:
            for i in changed:
                dist.broadcast(self.tensors[i], src=0)
        return value

    def close(self) -> None:
        dist.destroy_process_group(self._control)

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self._control)

    def _receive(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]


def check_one_host_id(given: str | None, *, spans_machines: bool) -> None:
    """Every rank of a host of several devices, once its process group is up: the host id this rank was given
    (``NodeoxStrategy(host_id=...)`` or ``NODEOX_HOST_ID``; None: none) must be rank 0's; on a host that spans
    machines every machine must be given it. The same ValueError on every rank otherwise."""
    ids: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ids, given)
    problem = host_id_problem(ids, spans_machines=spans_machines)
    if problem:
        raise ValueError(problem)


def host_id_problem(ids: list[str | None], *, spans_machines: bool) -> str | None:
    """What is wrong with the host ids given to the ranks of one host (``ids[r]``: rank r's), or None."""
    fix = ("set NODEOX_HOST_ID to the same value on every machine of the host (or pass the same "
           "NodeoxStrategy(host_id=...) everywhere)")
    if spans_machines and ids[0] is None:
        return (f"NodeoxStrategy: a host that spans machines (Trainer(num_nodes>1)) takes part in the run as one "
                f"host, but its rank 0 was given no host id (each machine would make up its own): {fix}")
    others = {rank: i for rank, i in enumerate(ids) if i != ids[0] and (spans_machines or i is not None)}
    if not others:
        return None
    shown = ", ".join(f"rank {rank}: {i!r}" for rank, i in list(others.items())[:4])
    return (f"NodeoxStrategy: the ranks of one host were given different host ids (rank 0: {ids[0]!r}; {shown}"
            f"{', ...' if len(others) > 4 else ''}): a host is one id at the coordinator; {fix}")


class WorldOfOne(ClusterEnvironment):
    """The cluster environment of a host with one device: rank 0 of a world of one, whatever launched it (so
    ``torchrun --nproc-per-node 8`` with ``devices=1`` makes 8 hosts, not one DDP world). Its local rank is the
    host's place among the hosts of its machine (:func:`lightning_nodeox.host.machine.local_rank`), so Lightning
    runs ``prepare_data`` on one host per machine."""

    def __init__(self, local_rank: int = 0) -> None:
        self._local_rank = local_rank

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return 1

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return 0

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return 0
