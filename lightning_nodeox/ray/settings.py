"""What a run on Ray is: how many hosts, where their coordinator keeps the run, what each host asks of the
cluster, and how often Ray may bring an actor back. Checked once, here, with the fix in each refusal."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class RaySettings:
    """A nodeox run on a Ray cluster.

    Args:
        hosts: hosts the run starts with (the coordinator's ``--hosts``; round 0 waits for them).
        run_dir: the coordinator's run directory, on the machine of the driver (the coordinator runs there, so a
            restarted coordinator finds it); started again on it, the run resumes.
        coordinator_args: more ``nodeox coordinator`` flags (``--outer-optimizer nesterov``, ``--lease 5``, ...).
        relay_args: more ``nodeox relay`` flags (with ``sites``).
        sites: relays between the coordinator and the hosts (``nodeox launch --sites``); 0 or 1: none.
        gpus_per_host: GPUs of each host: 0 (CPU), 1, or K > 1: one actor per GPU kept on one machine (a placement
            group, STRICT_PACK), running ``Trainer(devices=K)`` as DDP inside the host.
        cpus_per_host: CPUs Ray reserves for each host actor (for each rank of a host of several GPUs).
        host_resources: custom Ray resources each host actor needs (``{"spot": 1}``).
        max_restarts: how many times Ray brings back each host and server actor that dies.
        max_hosts: hosts the run may grow to (the coordinator gets ``--elastic``): the hosts beyond ``hosts`` are
            started as Ray finds resources for them.
        min_hosts: fewest deltas a round closes with (the coordinator's ``--min-hosts``): below it, the run waits.
        store: the run's object store (``--store URL``): a restarted coordinator resumes from it.
        bind_host: the address the coordinator and relays listen on; None: the address of their Ray node.
        coordinator_cpus: CPUs Ray reserves for the coordinator (and each relay).
        timeout: seconds the whole run may take; past it, every actor is stopped (the run is resumable).
    """

    hosts: int
    run_dir: Path
    coordinator_args: tuple[str, ...] = ()
    relay_args: tuple[str, ...] = ()
    sites: int = 1
    gpus_per_host: int = 0
    cpus_per_host: float = 1.0
    host_resources: dict[str, float] = field(default_factory=dict)
    max_restarts: int = 3
    max_hosts: int | None = None
    min_hosts: int | None = None
    store: str | None = None
    bind_host: str | None = None
    coordinator_cpus: float = 1.0
    timeout: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir).resolve())
        object.__setattr__(self, "coordinator_args", tuple(self.coordinator_args))
        object.__setattr__(self, "relay_args", tuple(self.relay_args))
        object.__setattr__(self, "sites", max(1, self.sites))
        if self.hosts < 1:
            raise ValueError(f"hosts={self.hosts}: a run needs at least one host")
        if self.gpus_per_host < 0:
            raise ValueError(f"gpus_per_host={self.gpus_per_host}: give 0 (CPU hosts), 1, or the GPUs of a host")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts}: give 0 (no restarts) or more")
        if self.max_hosts is not None and self.max_hosts < self.hosts:
            raise ValueError(f"max_hosts={self.max_hosts} is below hosts={self.hosts}: give at least {self.hosts}, "
                             "or None for a run that does not grow")
        if self.max_hosts is not None and self.max_hosts > self.hosts and self.sites > 1:
            raise ValueError("a run with sites does not grow on Ray yet: give max_hosts=None with sites")
        if self.min_hosts is not None and not 1 <= self.min_hosts <= self.all_hosts:
            raise ValueError(f"min_hosts={self.min_hosts}: give 1 to {self.all_hosts} (the hosts the run may have)")

    @property
    def all_hosts(self) -> int:
        """The hosts the run may have: ``max_hosts``, or ``hosts`` for a run that does not grow."""
        return self.max_hosts or self.hosts

    @property
    def grows(self) -> bool:
        return self.all_hosts > self.hosts

    def root_flags(self) -> list[str]:
        """The flags this object adds to the coordinator's (before ``coordinator_args``: a flag given there wins)."""
        flags = ["--elastic"] if self.grows else []
        if self.min_hosts is not None:
            flags += ["--min-hosts", str(self.min_hosts)]
        if self.store is not None:
            flags += ["--store", self.store]
        return flags
