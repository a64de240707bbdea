"""The driver's handle on one host: its actor (or, for a host of K GPUs, its K rank actors in a placement group
that keeps them on one machine, STRICT_PACK), the calls of its training function in flight, and its restarts.

Ray brings a dead actor back (``max_restarts``); the driver then calls the training function on it again, and the
host rejoins the run with its id. For a host of several ranks, one dead rank restarts the whole host (its DDP
cannot go on without it): the other ranks are killed too, for Ray to bring back, and all are called again once
every rank is back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .hosts import HostActor
from .settings import RaySettings


def host_name(host: int, rank: int = 0) -> str:
    """The actor's name, as Ray's dashboard, ``ray list actors`` and the log prefix show it."""
    return f"nodeox-host-{host}" + (f"-rank-{rank}" if rank else "")


class Host:
    """Host ``host`` of the run: its actors, made (pending until Ray has their resources) when this is."""

    def __init__(self, host: int, env: dict[str, str], settings: RaySettings, namespace: str) -> None:
        self.host, self.settings = host, settings
        self.ranks = max(1, settings.gpus_per_host)
        self.restarts = 0
        self.refs: list[ray.ObjectRef] = []  # the current attempt's calls, by rank
        self.ended: dict[int, tuple[str, Any]] = {}  # rank -> how its call of the current attempt ended
        self.probes: list[ray.ObjectRef] = []  # after a death: the calls that return once the actors are back
        bundle = {"CPU": settings.cpus_per_host, **settings.host_resources}
        if settings.gpus_per_host:
            bundle["GPU"] = 1
        self.group = placement_group([bundle] * self.ranks, strategy="STRICT_PACK") if self.ranks > 1 else None
        actor = ray.remote(HostActor)
        self.actors = []
        for rank in range(self.ranks):
            placed = {} if self.group is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=rank)}
            self.actors.append(actor.options(
                name=host_name(host, rank), namespace=namespace, max_restarts=settings.max_restarts,
                max_task_retries=0, num_cpus=settings.cpus_per_host, num_gpus=min(1, settings.gpus_per_host),
                resources=dict(settings.host_resources), **placed).remote(host_name(host, rank), env))

    def start(self, fn: Callable[[Any], Any], config: Any) -> list[ray.ObjectRef]:
        """Call ``fn(config)`` on every rank (a host of several ranks: once each knows where the others are);
        the calls' references, this attempt's."""
        infos = [a.rank_info.remote() for a in self.actors] if self.ranks > 1 else []
        self.refs = [a.train.remote(fn, config, rank, *infos) for rank, a in enumerate(self.actors)]
        self.ended = {}
        return self.refs

    def current(self, ref: ray.ObjectRef) -> bool:
        """Whether ``ref`` is a call of this host's current attempt (not one a restart gave up)."""
        return ref in self.refs

    def revive(self) -> list[ray.ObjectRef]:
        """After a rank's actor died: calls that return once each rank's actor is back (Ray restarts it; a call
        made while it restarts would fail, these are retried until it is back), and raise if Ray gave it up
        (``max_restarts`` used). :meth:`start` follows once all have returned."""
        self.restarts += 1
        self.refs, self.ended = [], {}
        if self.ranks > 1:
            for a in self.actors:
                ray.kill(a, no_restart=False)  # the dead one is restarting already; the others follow
        self.probes = [a.pid.options(max_task_retries=-1).remote() for a in self.actors]
        return self.probes

    def stop(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
