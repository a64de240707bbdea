"""A nodeox run on a Ray cluster, driven from the driver: :func:`start` starts the servers (:mod:`.servers`) and
every host (:mod:`.group`), and a thread of the driver watches them to the run's end (:meth:`RayRun.wait` for it).

While it waits: a host whose actor died is called again once Ray has brought it back (it rejoins with its id),
until it has used ``max_restarts``; a server whose actor died is waited on again (Ray retries the wait on the
restarted actor, whose process resumes the run). Hosts beyond ``hosts`` (``max_hosts``) wait in Ray's queue for
resources and join when they get them.

The run ends when the coordinator's process ends: status 0, the run completed (hosts still queued are dropped, the
final model is read); anything else stops every actor and raises (the run is saved, and starting it again on the
same run directory resumes it).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from ..tools.environments import host_variables
from ..tools.topology import Topology
from .finalmodel import FinalModel
from .group import Host
from .hosts import DONE
from .results import Ending, HostResult, RunResult
from .servers import Servers, start_servers
from .settings import RaySettings


class RayRun:
    """A run started on the cluster (:func:`start`); :meth:`wait` for its result."""

    def __init__(self, fn: Callable[[Any], Any], config: Any, settings: RaySettings) -> None:
        self.fn, self.config, self.settings = fn, config, settings
        self.namespace = f"nodeox-{uuid.uuid4().hex[:8]}"
        self.started = time.monotonic()
        topology = Topology.of(settings.hosts, settings.sites, settings.run_dir)
        warn_if_too_small(settings, len(topology.relays))
        self.servers: Servers = start_servers(settings, topology, self.namespace)
        self.hosts: dict[int, Host] = {}
        self.results: dict[int, HostResult] = {}
        self.pending: dict[ray.ObjectRef, tuple[str, int]] = {}  # a call in flight -> (kind, host or server)
        for k, server in enumerate(self.servers.actors):  # retried on the actor Ray restarts, until it gives up
            self.pending[server.wait.options(max_task_retries=-1).remote()] = ("server", k)
        try:
            for i in range(settings.all_hosts):
                url = topology.host_url(i, self.servers.url, self.servers.relay_urls) if i < settings.hosts else \
                    self.servers.url
                env = host_variables(i, url, settings.all_hosts, settings.run_dir, self.servers.token)
                self.hosts[i] = Host(i, env, settings, self.namespace)
                self.pending.update((ref, ("host", i)) for ref in self.hosts[i].start(fn, config))
        except BaseException:
            self.stop()
            raise
        self._outcome: RunResult | BaseException | None = None
        self._watcher = threading.Thread(target=self._watch, name="nodeox-ray-driver", daemon=True)
        self._watcher.start()

    def host_actor(self, host: int, rank: int = 0) -> ray.actor.ActorHandle:
        """Host ``host``'s actor (of rank ``rank``)."""
        return self.hosts[host].actors[rank]

    def wait(self) -> RunResult:
        """Wait for the run's end (it is watched from :func:`start` on, in a thread of this process): its result,
        or the error that ended it once every actor is stopped."""
        self._watcher.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _watch(self) -> None:
        """Watch the run to its end, restarting calls as actors come back; then stop every actor."""
        model = None
        try:
            while model is None:
                model = self._next()
            self._settle_hosts()
            self._outcome = RunResult(dict(sorted(self.results.items())), model, self.settings.run_dir)
        except BaseException as e:  # handed to wait()
            self._outcome = e
        finally:
            self.stop()

    def _next(self) -> FinalModel | None:
        """Take the next call that ended; the final model once the coordinator has ended the run."""
        left = None if self.settings.timeout is None else self.started + self.settings.timeout - time.monotonic()
        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=None if left is None else max(0.0, left))
        if not ready:
            raise TimeoutError(f"the run on Ray did not complete within {self.settings.timeout} s (timeout); it is "
                               f"saved in {self.settings.run_dir}: start it again there to resume it")
        kind, key = self.pending.pop(ready[0])
        if kind == "host":
            self._host_call_ended(key, ready[0])
            return None
        if kind == "revived":
            self._host_revived(key, ready[0])
            return None
        return self._server_ended(key, ready[0])

    def _host_call_ended(self, i: int, ref: ray.ObjectRef) -> None:
        host = self.hosts[i]
        if not host.current(ref):
            return  # a call of an attempt a restart gave up
        try:
            ending, value = ray.get(ref)
        except RayTaskError as e:  # the training function raised
            self._host_done(i, HostResult(i, Ending.FAILED, restarts=host.restarts, error=str(e)))
            return
        except RayActorError:  # the actor died: Ray brings it back, then it is called again
            print(f"nodeox ray: host {i}'s actor died; Ray restarts it (restart {host.restarts + 1} of at most "
                  f"{self.settings.max_restarts}) and it rejoins the run", flush=True)
            self.pending.update((r, ("revived", i)) for r in host.revive())
            return
        host.ended[host.refs.index(ref)] = (ending, value)
        if len(host.ended) == host.ranks:  # every rank of the host is done: rank 0's value is the host's
            ending, value = host.ended[0]
            self.results[i] = HostResult(i, Ending.DONE if ending == DONE else Ending.LATE,
                                         value=value if ending == DONE else None, restarts=host.restarts)

    def _host_revived(self, i: int, ref: ray.ObjectRef) -> None:
        """One rank's actor of host ``i`` is back (or gone for good); once all are back, train again."""
        host = self.hosts[i]
        if ref not in host.probes:
            return
        host.probes.remove(ref)
        try:
            ray.get(ref)
        except RayActorError as e:
            self._host_done(i, HostResult(i, Ending.FAILED, restarts=host.restarts,
                                          error=f"its actor died more often than max_restarts allows: {e}"))
            return
        if not host.probes:
            self.pending.update((r, ("host", i)) for r in host.start(self.fn, self.config))

    def _host_done(self, i: int, result: HostResult) -> None:
        self.results[i] = result
        for ref in [r for r, (kind, key) in self.pending.items() if kind in ("host", "revived") and key == i]:
            del self.pending[ref]
        self.hosts[i].refs, self.hosts[i].probes = [], []

    def _server_ended(self, k: int, ref: ray.ObjectRef) -> FinalModel | None:
        name = "coordinator" if k == 0 else f"relay {k - 1}"
        try:
            code, model = ray.get(ref)
        except RayActorError as e:
            raise RuntimeError(f"the {name}'s actor died more often than max_restarts allows; the run is saved in "
                               f"{self.settings.run_dir}") from e
        if code != 0:
            raise RuntimeError(f"the {name} ended with exit status {code} before the run completed (its output "
                               f"says why); the run is saved in {self.settings.run_dir}: start it again to resume")
        return model if k == 0 else None

    def _settle_hosts(self) -> None:
        """Once the run completed: every host still running ends within the coordinator's final wait (it did
        already: the coordinator exits after its hosts); hosts still queued never started."""
        for i, host in self.hosts.items():
            if i in self.results:
                continue
            refs = [r for r in host.refs if r in self.pending]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=5) if refs else ([], [])
            for ref in done:
                self.pending.pop(ref, None)
                self._host_call_ended(i, ref)
            if i not in self.results:
                self.results[i] = HostResult(i, Ending.NOT_STARTED, restarts=host.restarts)

    def stop(self) -> None:
        """Kill every actor of the run: the hosts, then the relays and the coordinator (saving the run)."""
        for host in self.hosts.values():
            host.stop()
        self.servers.stop()


def warn_if_too_small(settings: RaySettings, relays: int) -> None:
    """Say so when the cluster has fewer CPUs than the servers and the first hosts reserve: round 0 would wait for
    hosts Ray cannot start (until an autoscaler adds nodes)."""
    needed = settings.coordinator_cpus * (1 + relays) + settings.hosts * max(1, settings.gpus_per_host) * \
        settings.cpus_per_host
    has = ray.cluster_resources().get("CPU", 0)
    if has < needed:
        print(f"nodeox ray: the cluster has {has:g} CPUs, but the coordinator, relays and {settings.hosts} hosts "
              f"reserve {needed:g}: round 0 waits until Ray can start them all; add nodes, or lower cpus_per_host "
              "or coordinator_cpus (logical CPUs: ray start --num-cpus N)", flush=True)


def start(fn: Callable[[Any], Any], config: Any = None, **settings: Any) -> RayRun:
    """Start ``fn(config)`` as every host of a nodeox run on the Ray cluster this process is connected to
    (``ray.init()`` first); ``settings``: :class:`~.settings.RaySettings`'s."""
    if not ray.is_initialized():
        ray.init()
    return RayRun(fn, config, RaySettings(**settings))


def run(fn: Callable[[Any], Any], config: Any = None, **settings: Any) -> RunResult:
    """:func:`start`, then wait for the run's end: each host's return value and the final model."""
    return start(fn, config, **settings).wait()
