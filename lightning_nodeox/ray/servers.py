"""The run's servers on Ray, as ``nodeox launch`` shapes them (:class:`~lightning_nodeox.tools.topology.Topology`):
the coordinator, and with sites one relay per site under it. Each is a :class:`~.servers.ServerActor` on CPU,
pinned to the driver's node (so a restart finds its run directory and keeps its address), restarted by Ray up to
``max_restarts`` times. They share the run's token (``RUN_DIR/token``, made once and kept for a resume)."""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..tools.launch import run_token
from ..tools.topology import Topology
from .server_actor import COORDINATOR, ServerActor
from .settings import RaySettings


@dataclass
class Servers:
    """The coordinator's actor and URL, the relays' (in the topology's order), and the token hosts send."""

    coordinator: ray.actor.ActorHandle
    url: str
    relays: list[ray.actor.ActorHandle]
    relay_urls: list[str]
    token: str

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        return [self.coordinator, *self.relays]

    def stop(self) -> None:
        """Kill the actors (relays first); each process gets SIGTERM and saves its run, resumable."""
        for actor in reversed(self.actors):
            ray.kill(actor, no_restart=True)


def start_servers(settings: RaySettings, topology: Topology, namespace: str) -> Servers:
    """Start the coordinator, then the relays, and return once all serve (an error says which did not)."""
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    token_file = run_token(settings.run_dir)
    token = token_file.read_text().strip()
    options = dict(namespace=namespace, num_cpus=settings.coordinator_cpus, max_restarts=settings.max_restarts,
                   max_task_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                       ray.get_runtime_context().get_node_id(), soft=False))
    actor = ray.remote(ServerActor)
    root_args = ["coordinator", "--hosts", str(settings.hosts), "--run-dir", str(settings.run_dir),
                 "--token-file", str(token_file), *settings.root_flags(), *topology.root_args(
                     list(settings.coordinator_args))]
    coordinator = actor.options(name="nodeox-coordinator", **options).remote(
        COORDINATOR, root_args, str(settings.run_dir), str(settings.run_dir / ".coordinator-url"),
        settings.bind_host, namespace)
    relays: list[ray.actor.ActorHandle] = []
    try:
        url = ray.get(coordinator.url.remote())
        relay_flags = [*settings.relay_args, "--token-file", str(token_file), "--upstream-token-file",
                       str(token_file)]
        relays = [actor.options(name=f"nodeox-relay-{site.index}", **options).remote(
            site.name, site.args(url, relay_flags), str(site.run_dir), str(site.ready_file), settings.bind_host,
            namespace)
            for site in topology.relays]
        relay_urls = ray.get([r.url.remote() for r in relays])
    except BaseException:
        Servers(coordinator, "", relays, [], token).stop()  # none outlives a start that failed
        raise
    return Servers(coordinator, url, relays, relay_urls, token)
