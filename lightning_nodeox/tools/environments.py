"""The environment of each process ``nodeox launch`` starts, and where on this machine each host runs.

Every process inherits launch's environment, with ``PYTHONUNBUFFERED=1``. Host i gets ``NODEOX_HOST_ID=i``,
``NODEOX_LOCAL_HOST_RANK=i`` (its place on this machine), ``NODEOX_NUM_HOSTS``, ``NODEOX_COORDINATOR_URL`` (the
coordinator's, or its relay's), ``NODEOX_TOKEN`` (when set) and ``NODEOX_RUN_DIR``. With ``--tls-cert``, whatever
connects to the coordinator itself (the hosts, or the relays) gets ``NODEOX_CA_FILE`` set to that certificate unless
the environment sets it (right for a self-signed certificate); relays serve their hosts plain.

When this machine has at least N x ``gpus_per_host`` GPUs each host sees only its own (``CUDA_VISIBLE_DEVICES``),
and when it has at least N CPUs each host is pinned to its own share of them (and ``OMP_NUM_THREADS`` is that
share's size), so that the hosts do not oversubscribe the CPU; a variable the environment sets is left as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..coordinator.config import CoordinatorConfig
from ..core.cpu import granted_cpus
from ..core.settings import (
    ENV_CA_FILE, ENV_HOST_ID, ENV_LOCAL_RANK, ENV_NUM_HOSTS, ENV_RUN_DIR, ENV_TOKEN, ENV_URL,
)


def gpu_count() -> int:
    """NVIDIA GPUs on this machine, from the driver (importing torch here would cost launch 0.7 GiB)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def gpu_sets(gpus: int, hosts: int, per_host: int) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each host: its own ``per_host`` GPUs when there are enough, else None (every
    host sees every GPU)."""
    if gpus < hosts * per_host:
        return [None] * hosts
    return [",".join(str(i * per_host + j) for j in range(per_host)) for i in range(hosts)]


def cpu_shares(hosts: int) -> list[list[int] | None]:
    """Disjoint CPU sets for the hosts when there are enough CPUs; None (no pinning) otherwise."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [None] * hosts
    per = min(len(cpus), granted_cpus()) // hosts
    if per < 1:
        return [None] * hosts
    return [cpus[i * per : (i + 1) * per] for i in range(hosts)]


def host_variables(host: int | str, url: str, hosts: int, run_dir: Path, token: str | None) -> dict[str, str]:
    """The ``NODEOX_*`` variables of host ``host`` joining at ``url``, in a run of ``hosts`` hosts (also the
    environment of a host on Ray, :mod:`lightning_nodeox.ray.hosts`)."""
    env = {ENV_HOST_ID: str(host), ENV_NUM_HOSTS: str(hosts), ENV_URL: url, ENV_RUN_DIR: str(run_dir)}
    if token:
        env[ENV_TOKEN] = token
    return env


@dataclass(frozen=True)
class Placement:
    """Where each host runs on this machine: its GPUs (``CUDA_VISIBLE_DEVICES``) and its CPUs; None: all of them.
    ``note``: the line to show when the GPUs are too few to give each host its own."""

    gpus: list[str | None]
    cpus: list[list[int] | None]
    note: str | None

    @classmethod
    def of(cls, hosts: int, gpus_per_host: int) -> Placement:
        gpus = gpu_count()
        note = None
        if 0 < gpus < hosts * gpus_per_host and "CUDA_VISIBLE_DEVICES" not in os.environ:
            note = f"nodeox launch: {gpus} GPUs for {hosts} hosts of {gpus_per_host}: every host sees every GPU"
        return cls(gpu_sets(gpus, hosts, gpus_per_host), cpu_shares(hosts), note)


class Environments:
    """The environments of one launch's processes, built on launch's own."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self._base = dict(os.environ, PYTHONUNBUFFERED="1")
        self._run_dir, self._hosts, self._token = Path(config.run_dir), config.hosts, config.token
        given_ca = config.tls_cert is not None and ENV_CA_FILE not in os.environ
        self._ca = {ENV_CA_FILE: str(Path(config.tls_cert).resolve())} if given_ca else {}

    def coordinator(self) -> dict[str, str]:
        return dict(self._base)

    def relay(self) -> dict[str, str]:
        """A relay's: it connects to the coordinator."""
        return {**self._base, **self._ca}

    def host(self, host: int, url: str, placement: Placement, *, reaches_the_root: bool) -> dict[str, str]:
        """Host ``host``'s, joining at ``url`` (the coordinator itself when ``reaches_the_root``, else a relay)."""
        env = {**self._base, **host_variables(host, url, self._hosts, self._run_dir, self._token),
               ENV_LOCAL_RANK: str(host)}
        if reaches_the_root:
            env.update(self._ca)
        gpus, cpus = placement.gpus[host], placement.cpus[host]
        if gpus is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        if cpus is not None and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(len(cpus))
        return env
