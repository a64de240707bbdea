"""A host as a Ray actor: the user's training function, called in the actor's own process (its main thread, so
Lightning's and nodeox's SIGTERM handling work as in a plain process) with the host's ``NODEOX_*`` variables set.

A host of several GPUs is one actor per GPU (:mod:`.group` places them on one machine); each rank's actor is told
the others' address and GPUs before training, and sets what Lightning's DDP reads to start inside the host:
``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``NODE_RANK``, ``LOCAL_RANK`` and
``CUDA_VISIBLE_DEVICES`` (all the host's GPUs, as ``torchrun`` leaves them; Ray would show each rank its own).

How a call ends: the function's value; ``("late", ...)`` when the run had completed before this host took part
(``RunCompleted``, a host grown too late); an error of the function, raised to the driver. A SIGTERM (preemption)
makes the host leave the run as it does anywhere, then ends the actor's process with status 143, so that Ray brings
the actor back (``max_restarts``) and the driver calls the function again: it rejoins with its id.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .ports import free_port

DONE, LATE = "done", "late"


@dataclass(frozen=True)
class RankInfo:
    """Where one rank of a host runs: its node's address, a free port there (rank 0's is the host's
    ``MASTER_PORT``) and the GPUs Ray gave it."""

    address: str
    port: int
    gpus: tuple[str, ...]


def group_variables(rank: int, infos: tuple[RankInfo, ...]) -> dict[str, str]:
    """What Lightning's DDP reads, for rank ``rank`` of a host whose ranks are ``infos`` (rank 0 first)."""
    gpus = sorted({g for info in infos for g in info.gpus}, key=lambda g: (len(g), g))
    own = infos[rank].gpus
    env = {"MASTER_ADDR": infos[0].address, "MASTER_PORT": str(infos[0].port), "WORLD_SIZE": str(len(infos)),
           "RANK": str(rank), "NODE_RANK": "0", "LOCAL_RANK": str(gpus.index(own[0]) if own else rank)}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


class HostActor:
    """One host, or one rank of a host of several GPUs (``name``: ``nodeox-host-3``, ``nodeox-host-3-rank-1``),
    with the host's variables ``env``. Made a Ray actor by :mod:`.group`."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        os.environ.update(env)

    def __repr__(self) -> str:
        return self.name  # Ray's log prefix for this actor: (nodeox-host-3 pid=...)

    def rank_info(self) -> RankInfo:
        import ray

        address = ray.util.get_node_ip_address()
        return RankInfo(address, free_port(""), tuple(str(g) for g in ray.get_gpu_ids()))

    def pid(self) -> int:
        return os.getpid()

    def train(self, fn: Callable[[Any], Any], config: Any, rank: int = 0, *infos: RankInfo) -> tuple[str, Any]:
        """``fn(config)`` as this host (rank ``rank`` of ``infos``, when the host has several)."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from ..host.ending import RunCompleted

        if infos:
            os.environ.update(group_variables(rank, infos))
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Ray's handler would exit before the host leaves
        try:
            return DONE, fn(config)
        except RunCompleted as e:
            return LATE, str(e)
        except SIGTERMException:
            print(f"{self.name}: SIGTERM: left the run; ending this actor's process (Ray restarts it)", flush=True)
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)
        finally:
            signal.signal(signal.SIGTERM, previous)
