"""Coordinator settings, validated once, with errors that name the fix."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ..core.codecs.settings import CodecSettings, Q4Settings
from ..core.stores import open_store
from .merging import MergeSettings
from .outer import OuterSettings

DEFAULT_PORT = 8470
NAME = "nodeox coordinator"  # what its lines start with (core/logs.Named)


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:PORT`` binds all interfaces; port 0 picks a free one)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--bind {bind!r} is not HOST:PORT; write e.g. --bind 0.0.0.0:{DEFAULT_PORT}")
    return (host.strip("[]") or "0.0.0.0"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume other machines can reach it


@dataclass(frozen=True)
class CoordinatorConfig:
    """How the coordinator runs.

    Args:
        hosts: hosts expected; the run's first round waits until this many have joined (or ``round_timeout``).
        run_dir: where events.jsonl, TensorBoard files and the run's state (``state/``) go.
        bind: ``HOST:PORT`` to listen on.
        min_hosts: the fewest deltas a round closes with (None: 1), lowered to the number of hosts that have not
            finished, so finishing hosts never block the end of the run.
        round_timeout: seconds a round waits for its last live hosts (None: wait for every live host).
        lease: seconds a host stays expected without a heartbeat; then it is dropped until it is heard from again.
        no_hosts_timeout: seconds the run waits with no live host (every host dropped or left) before the
            coordinator stops, the run saved unfinished: started again, it resumes. Raise it when hosts may be
            cut off or restarted for longer.
        final_wait: seconds a completed run waits, at most, for the hosts whose delta was in its final round and
            that have not left (one paused past its lease included) to fetch the final model before the
            coordinator exits. Raise it when hosts may be paused (SIGSTOP, a suspended VM) for longer.
        snapshot_every: write the model to ``state/`` every this many rounds (and at shutdown); between snapshots a
            restarted coordinator takes the model back from a host that holds it.
        transfer_timeout: seconds any upload or download may take, plus one second per MB of it.
        idle_timeout: seconds a connection may wait for its next request's headers (from its opening or its last
            response); then it is closed, so half-sent requests and idle keep-alives free their files.
        max_connections: connections open at once (None: sized from the open-file limit); beyond it a new one
            closes the one that has waited longest for a request (refused only when every one is busy).
        fresh: start a new run even if ``run_dir`` holds an unfinished one (its records are moved aside).
        token: bearer token every request must carry (None: no authentication; then ``bind`` must be a
            loopback address unless ``insecure``).
        insecure: allow binding beyond loopback without a token (a network you trust entirely).
        elastic: admit more than ``hosts`` distinct host ids (by default a join beyond them is refused).
        tls_cert: PEM certificate (chain) to serve HTTPS with; needs ``tls_key``.
        tls_key: PEM private key of ``tls_cert``.
        codec: the run's codec settings (a codec's own class, e.g. ``Q2Settings(block_size=256)``; hosts follow it).
        initial_model: a safetensors file to start from (None: the first host to join provides the model).
        threads: codec threads (None: the CPU quota granted to this process).
        rss_interval: seconds between memory samples.
        exit_when_done: stop once every host has finished and said goodbye.
        outer: the outer optimizer (plain averaging, or DiLoCo's Nesterov momentum).
        merge: how rounds close and take late deltas: every live host's (``sync``, the default), or a quorum's
            with late deltas merged into a later round (``async``; :mod:`~lightning_nodeox.coordinator.merging`).
        gpu_hour_price: the price of one GPU for one hour (None: not given); the status page then says what the
            hosts' waiting cost.
        store: the run's object store (``s3://bucket/prefix`` or ``file:///path``; None: none): each round's sync
            and the model are written there once and hosts read them from it, and the run's state is copied there
            so that a coordinator on another machine takes the run up (:mod:`lightning_nodeox.core.stores`).
        store_deltas: hosts write their deltas to the store too (a presigned PUT per piece) and the coordinator
            reads them there, instead of receiving them over HTTP.
        store_own_credentials: hosts read the store's objects with credentials of their own (their addresses,
            ``s3://...``) instead of presigned URLs.
        store_lease: seconds the run's lease in ``store`` lasts unrenewed (renewed every third of it): a coordinator
            killed with its machine is followed by another this long after, at most
            (:mod:`lightning_nodeox.coordinator.lease`).
        data_unit: samples per unit of the data ledger (``--data-unit``, default 256), for hosts that declare their
            data at join (docs/ledger.md): smaller shortens an epoch's tail and what a lost host takes with it,
            larger makes leases rarer. The run's, not a host's: every host leases from one ledger.
        name: what the run's log lines start with (a site relay's: ``nodeox relay ID``, set by ``nodeox relay``).
    """

    hosts: int
    run_dir: Path
    bind: str = f"127.0.0.1:{DEFAULT_PORT}"
    min_hosts: int | None = None
    round_timeout: float | None = None
    token: str | None = None
    insecure: bool = False
    elastic: bool = False
    tls_cert: Path | None = None
    tls_key: Path | None = None
    codec: CodecSettings = Q4Settings()
    initial_model: Path | None = None
    threads: int | None = None
    rss_interval: float = 2.0
    exit_when_done: bool = True
    outer: OuterSettings = field(default_factory=OuterSettings)
    merge: MergeSettings = field(default_factory=MergeSettings)
    provider_timeout: float = 300.0
    long_poll: float = 30.0
    lease: float = 10.0
    no_hosts_timeout: float = 600.0
    final_wait: float = 120.0
    snapshot_every: int = 10
    transfer_timeout: float = 60.0
    idle_timeout: float = 30.0
    max_connections: int | None = None
    fresh: bool = False
    status_interval: float = 5.0
    gpu_hour_price: float | None = None
    store: str | None = None
    store_own_credentials: bool = False
    store_deltas: bool = False
    store_lease: float = 30.0
    data_unit: int = 256
    name: str = NAME

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise ValueError(f"--hosts must be at least 1, got {self.hosts}")
        if self.min_hosts is not None and not 1 <= self.min_hosts <= self.hosts:
            raise ValueError(f"--min-hosts must be between 1 and --hosts ({self.hosts}), got {self.min_hosts}")
        if self.merge.min_quorum is not None and self.merge.min_quorum > self.hosts:
            raise ValueError(f"--min-quorum must be at most --hosts ({self.hosts}), got {self.merge.min_quorum}")
        if self.round_timeout is not None and self.round_timeout <= 0:
            raise ValueError(f"--round-timeout must be positive seconds, got {self.round_timeout}")
        if not self.lease > 0:
            raise ValueError(f"--lease must be positive seconds, got {self.lease}")
        if not self.no_hosts_timeout > 0:
            raise ValueError(f"--no-hosts-timeout must be positive seconds, got {self.no_hosts_timeout}")
        if not self.final_wait >= 0:
            raise ValueError(f"--final-wait must be seconds (>= 0), got {self.final_wait}")
        if self.snapshot_every < 1:
            raise ValueError(f"--snapshot-every must be at least 1 round, got {self.snapshot_every}")
        if not self.transfer_timeout > 0:
            raise ValueError(f"--transfer-timeout must be positive seconds, got {self.transfer_timeout}")
        if not self.idle_timeout > 0:
            raise ValueError(f"--idle-timeout must be positive seconds, got {self.idle_timeout}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.rss_interval <= 0:
            raise ValueError(f"--rss-interval must be positive seconds, got {self.rss_interval}")
        if self.gpu_hour_price is not None and not self.gpu_hour_price >= 0:
            raise ValueError(f"--gpu-hour-price must be the price of one GPU for one hour (>= 0), got "
                             f"{self.gpu_hour_price}")
        if self.initial_model is not None and not Path(self.initial_model).is_file():
            raise ValueError(f"--initial-model {self.initial_model} is not a file; pass a safetensors file")
        if isinstance(self.data_unit, bool) or not isinstance(self.data_unit, int) or self.data_unit < 1:
            raise ValueError(f"--data-unit must be at least 1 sample, got {self.data_unit}")
        if not self.store_lease > 0:
            raise ValueError(f"--store-lease must be positive seconds, got {self.store_lease}")
        if (self.store_deltas or self.store_own_credentials) and self.store is None:
            flag = "--store-deltas" if self.store_deltas else "--store-own-credentials"
            raise ValueError(f"{flag} needs --store URL (the store the payloads go through)")
        if self.store is not None:
            open_store(self.store)  # a URL of a known kind, its client installed (no call to it yet)
        host, _ = parse_bind(self.bind)
        if not self.token and not self.insecure and not is_loopback(host):
            raise ValueError(
                f"--bind {self.bind} listens beyond this machine, but no token is set: anyone who reaches it could "
                "join and send deltas. Pass --token-file F (and give hosts NODEOX_TOKEN), or --insecure on a network "
                "you trust entirely")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together: pass both (the certificate and its private key)")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path} is not a file; pass a PEM file")

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

    @property
    def quorum(self) -> int:
        """The fewest deltas a round closes with (before lowering it to the hosts that have not finished)."""
        return 1 if self.min_hosts is None else self.min_hosts
