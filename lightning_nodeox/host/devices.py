"""How NodeoxStrategy plays Lightning for a host of one device or of several: the whole difference in one object.

One device (:class:`OneDevice`) is Lightning's single-device strategy: rank 0 of a world of one whatever launched
the process, nothing launched, no process group, each host loading its own data (no ``DistributedSampler``), the
model unwrapped, and collectives that return their input. Several (:class:`SeveralDevices`) is Lightning's DDP over
the host's ranks: the K devices of one machine, or ``num_nodes`` machines of K devices each (a host that spans
machines, started by ``torchrun --nnodes`` or ``srun``). NodeoxStrategy subclasses DDPStrategy and hands each of
these methods to :func:`devices_of`'s answer.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy

from . import machine
from .ranks import HostRanks, OneRank, WorldOfOne, check_one_host_id


class OneDevice:
    """A host of one device: Lightning's single-device strategy."""

    def set_world_ranks(self, strategy: DDPStrategy) -> None:
        # its local rank: its place among the hosts on this machine (prepare_data)
        strategy.cluster_environment = WorldOfOne(machine.local_rank())
        DDPStrategy.set_world_ranks(strategy)

    def configure_launcher(self, strategy: DDPStrategy) -> None:
        strategy._launcher = None  # nothing to start: this process is the host

    def setup_environment(self, trainer: Trainer) -> None:
        # no DistributedSampler (Lightning has no public switch); the data ledger's sampler instead, when the
        # Trainer's use_distributed_sampler was on (host/ledger_data.py), else each host loads its own data
        trainer._accelerator_connector.use_distributed_sampler = False

    def setup_distributed(self, strategy: DDPStrategy, host_id: str | None) -> None:
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
    """A host of several ranks: Lightning's DDP over them, on one machine or across ``num_nodes`` machines."""

    def set_world_ranks(self, strategy: DDPStrategy) -> None:
        environment = strategy.cluster_environment
        if environment is not None and environment.creates_processes_externally:
            check_world_size(environment, len(strategy.parallel_devices or ()) or 1, strategy.num_nodes)
        DDPStrategy.set_world_ranks(strategy)

    def configure_launcher(self, strategy: DDPStrategy) -> None:
        DDPStrategy._configure_launcher(strategy)

    def setup_environment(self, trainer: Trainer) -> None:
        pass  # a DistributedSampler splits the host's data among its ranks (the data ledger's, when it shares out)

    def setup_distributed(self, strategy: DDPStrategy, host_id: str | None) -> None:
        DDPStrategy.setup_distributed(strategy)
        check_one_host_id(host_id, spans_machines=strategy.num_nodes > 1)

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
    """The host's shape, from the devices and machines Lightning gave the strategy: one device on one machine is a
    world of one; several devices, or several machines (``num_nodes``, even of one device each), are a DDP world."""
    devices = strategy.parallel_devices
    one_machine = getattr(strategy, "num_nodes", 1) == 1
    return ONE_DEVICE if one_machine and (not devices or len(devices) == 1) else SEVERAL_DEVICES


def check_world_size(environment: ClusterEnvironment, devices: int, machines: int) -> None:
    """A launcher (torchrun, srun) started the ranks: it must have started ``machines`` x ``devices`` of them (as
    the environment checks it: Lightning's own launcher does, but not one that starts processes itself), or the
    ranks would wait for each other forever, or train outside the host."""
    try:
        environment.validate_settings(num_devices=devices, num_nodes=machines)
    except ValueError as e:
        raise ValueError(
            f"NodeoxStrategy: a host of Trainer(num_nodes={machines}, devices={devices}) is {machines} machine(s) of "
            f"{devices} rank(s) each, but {type(environment).__name__} says: {e} Start it with `torchrun --nnodes "
            f"{machines} --nproc-per-node {devices}` on each machine (or `srun --nodes {machines} --ntasks-per-node "
            f"{devices}`), or set Trainer(num_nodes=..., devices=...) to what the launcher starts (see "
            "docs/clusters.md, 'A host that spans machines')") from None
