"""How NodeoxStrategy plays Lightning for a host of one device or of several: the whole difference in one object.

One device (:class:`OneDevice`) is Lightning's single-device strategy: rank 0 of a world of one whatever launched
the process, nothing launched, no process group, each host loading its own data (no ``DistributedSampler``), the
model unwrapped, and collectives that return their input. Several (:class:`SeveralDevices`) is Lightning's DDP over
the host's devices, which must be one machine. NodeoxStrategy subclasses DDPStrategy and hands each of these
methods to :func:`devices_of`'s answer.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy

from . import machine
from .ranks import HostRanks, OneRank, WorldOfOne


class OneDevice:
    """A host of one device: Lightning's single-device strategy."""

    def set_world_ranks(self, strategy: DDPStrategy) -> None:
        # its local rank: its place among the hosts on this machine (prepare_data)
        strategy.cluster_environment = WorldOfOne(machine.local_rank())
        DDPStrategy.set_world_ranks(strategy)

    def configure_launcher(self, strategy: DDPStrategy) -> None:
        strategy._launcher = None  # nothing to start: this process is the host

    def setup_environment(self, trainer: Trainer) -> None:
        # each host loads its own data: no DistributedSampler (Lightning has no public switch)
        trainer._accelerator_connector.use_distributed_sampler = False

    def setup_distributed(self, strategy: DDPStrategy) -> None:
        strategy.set_world_ranks()  # rank zero of its own world: its loggers write; no process group

    def setup(self, strategy: DDPStrategy, trainer: Trainer) -> None:
        Strategy.setup(strategy, trainer)  # the loaders keep their own samplers

    def setup_model(self, strategy: DDPStrategy, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def barrier(self, strategy: DDPStrategy, name: str | None, *args: Any, **kwargs: Any) -> None:
        if name == "pre_setup":  # the hosts of one machine wait until its local rank 0 has run prepare_data
            machine.after_prepare_data(strategy.lightning_module.trainer, strategy.local_rank)

    def broadcast(self, strategy: DDPStrategy, obj: Any, src: int) -> Any:
        return obj

    def reduce(self, strategy: DDPStrategy, tensor: Any, group: Any, reduce_op: Any) -> Any:
        return tensor

    def all_gather(self, strategy: DDPStrategy, tensor: torch.Tensor, group: Any, sync_grads: bool) -> torch.Tensor:
        return tensor

    def ranks(self, tensors: list[torch.Tensor], *, per_step: bool) -> OneRank:
        return OneRank()


class SeveralDevices:
    """A host of several devices: Lightning's DDP over its ranks, on one machine."""

    def set_world_ranks(self, strategy: DDPStrategy) -> None:
        if strategy.num_nodes != 1:
            raise ValueError(
                f"NodeoxStrategy joins machines through its coordinator: a host is one machine, got "
                f"Trainer(num_nodes={strategy.num_nodes}). Use Trainer(devices=K, num_nodes=1, "
                "strategy=NodeoxStrategy()) and start each machine as its own host with its own NODEOX_HOST_ID (on "
                "SLURM: one task per node running `torchrun --standalone --nproc-per-node K`; see docs/clusters.md)")
        DDPStrategy.set_world_ranks(strategy)

    def configure_launcher(self, strategy: DDPStrategy) -> None:
        DDPStrategy._configure_launcher(strategy)

    def setup_environment(self, trainer: Trainer) -> None:
        pass  # a DistributedSampler splits the host's data among its ranks

    def setup_distributed(self, strategy: DDPStrategy) -> None:
        DDPStrategy.setup_distributed(strategy)

    def setup(self, strategy: DDPStrategy, trainer: Trainer) -> None:
        DDPStrategy.setup(strategy, trainer)  # the model wrapped, the loaders given a DistributedSampler

    def setup_model(self, strategy: DDPStrategy, model: torch.nn.Module) -> torch.nn.Module:
        return DDPStrategy._setup_model(strategy, model)

    def barrier(self, strategy: DDPStrategy, name: str | None, *args: Any, **kwargs: Any) -> None:
        DDPStrategy.barrier(strategy, name, *args, **kwargs)

    def broadcast(self, strategy: DDPStrategy, obj: Any, src: int) -> Any:
        return DDPStrategy.broadcast(strategy, obj, src)

    def reduce(self, strategy: DDPStrategy, tensor: Any, group: Any, reduce_op: Any) -> Any:
        return DDPStrategy.reduce(strategy, tensor, group, reduce_op)

    def all_gather(self, strategy: DDPStrategy, tensor: torch.Tensor, group: Any, sync_grads: bool) -> torch.Tensor:
        return DDPStrategy.all_gather(strategy, tensor, group, sync_grads)

    def ranks(self, tensors: list[torch.Tensor], *, per_step: bool) -> HostRanks:
        return HostRanks(tensors, per_step=per_step)


ONE_DEVICE = OneDevice()
SEVERAL_DEVICES = SeveralDevices()


def devices_of(strategy: Strategy) -> OneDevice | SeveralDevices:
    """The host's shape, from the devices Lightning gave the strategy."""
    devices = strategy.parallel_devices
    return ONE_DEVICE if not devices or len(devices) == 1 else SEVERAL_DEVICES
