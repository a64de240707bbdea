"""The run as someone watching it sees it (the status page, ``nodeox status``): what ``GET /v1/status`` adds as
``live``.

A listener of the run's records (:attr:`RunState.listeners`) keeps, per host, counters since this coordinator
started and its last :data:`KEEP` rounds; what it keeps is bounded by hosts x rounds kept, whatever the run's
length, and it adds nothing to a round's work but a few dict updates per record (records arrive once a second
per host). :meth:`RunWatch.snapshot` reads it with the registry and the open round:

- the run: ``state`` (``waiting for hosts``, ``waiting for the model``, ``running``, ``no live host``,
  ``hosts gone`` (every host left, the run unfinished: failed), ``complete``), round, published round, model
  hash;
- each host: ``state`` (``training``; ``uploading`` its delta; ``waiting`` for the sync; ``late``: the round
  waits for it alone; ``gone``: its lease expired; ``finished``; ``left``), lease age, last round, wait share
  and bytes per round over its last rounds, sync_dist values of its last delta, and its last loss (a logged
  value whose name holds ``loss``, or a ``loss`` field of its ``train`` record);
- the coordinator's memory (RSS, peak) and CPU seconds, bytes per second over the links in the last rounds;
- the timeline of the last :data:`TIMELINE` rounds: per lane (``coordinator``, each host; a relay's own
  exchange with its upstream, under its id) its phases;
- with ``--gpu-hour-price``, GPU-hours training and waiting per host since this coordinator started, and
  what the waiting cost.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from ..core.host_order import host_order
from ..core import phases as P
from .hosts import HostState
from .rounds import Rounds
from .runstate import RunState

KEEP = 16  # rounds kept per host for wait shares and bytes
TIMELINE = 6  # rounds the timeline shows
TRAFFIC = (P.UPLOAD, P.DOWNLOAD, P.FALLBACK_FETCH, P.PROVIDE_MODEL)  # phases whose bytes cross a link


@dataclass
class _Round:
    train_start: float | None = None
    train_s: float = 0.0
    bytes: int = 0
    start: float = float("inf")
    end: float = 0.0
    phases: list = field(default_factory=list)  # [phase, start, end]


@dataclass
class _Host:
    rounds: dict[int, _Round] = field(default_factory=dict)
    train_s: float = 0.0
    wait_s: float = 0.0
    gpus: int = 1
    loss: float | None = None
    metrics: dict = field(default_factory=dict)

    def round(self, r: int) -> _Round:
        got = self.rounds.get(r)
        if got is None:
            got = self.rounds[r] = _Round()
            while len(self.rounds) > KEEP:
                del self.rounds[min(self.rounds)]
        return got


class RunWatch:
    """Listens to the run's records; :meth:`snapshot` is the run as a watcher sees it now."""

    def __init__(self, state: RunState, rounds: Rounds) -> None:
        self.state = state
        self.rounds = rounds
        self.hosts: dict[str, _Host] = defaultdict(_Host)
        self.coordinator = _Host()
        self.memory: dict = {}
        self.started = time.time()
        state.listeners.append(self.record)

    def record(self, r: P.PhaseRecord) -> None:
        if r.phase == P.RSS:
            self.memory = {k: r.extra.get(k) for k in ("rss_bytes", "peak_rss_bytes", "cpu_s")}
            return
        if r.phase in (P.RESTART, P.DATA) or "/" in r.host:  # a site's records: its relay's page shows them
            return
        if r.host == P.COORDINATOR:
            self.coordinator.round(r.round).phases.append([r.phase, r.start, r.end])
            if r.phase == P.RECEIVE and r.extra.get("from_host"):
                self._metrics(str(r.extra["from_host"]))
            return
        host = self.hosts[r.host]
        rnd = host.round(r.round)
        rnd.phases.append([r.phase, r.start, r.end])
        rnd.start, rnd.end = min(rnd.start, r.start), max(rnd.end, r.end)
        if r.phase == P.TRAIN:
            rnd.train_start = r.start if rnd.train_start is None else min(rnd.train_start, r.start)
            rnd.train_s += r.seconds
            host.train_s += r.seconds
            host.gpus = max(host.gpus, int(r.extra.get("ranks") or 1))
            if isinstance(r.extra.get("loss"), (int, float)):
                host.loss = float(r.extra["loss"])
        elif r.phase == P.WAIT:
            host.wait_s += r.seconds
        if r.phase in TRAFFIC and r.bytes:
            rnd.bytes += r.bytes

    def _metrics(self, host: str) -> None:
        """The sync_dist values of ``host``'s delta just received (``{name: [value, reduction]}``)."""
        metrics = self.rounds.deltas.metrics_of(host)
        if metrics:
            entry = self.hosts[host]
            entry.metrics = {name: value for name, (value, _) in metrics.items()}
            losses = [v for name, v in entry.metrics.items() if "loss" in name.lower()
                      and not name.lower().startswith(("val", "test"))]
            if losses:
                entry.loss = float(losses[0])

    # -- reading --------------------------------------------------------------------------------------------
    def run_state(self) -> str:
        state, rounds = self.state, self.rounds
        registry = state.hosts
        if state.complete:
            return "complete"
        if registry and all(h.state is HostState.LEFT for h in registry.values()):
            return "hosts gone"
        if rounds.open.joins_awaited():
            return "waiting for hosts"
        if state.model is None:
            return "waiting for the model"
        if not registry.live():
            return "no live host"
        return "running"

    def host_state(self, host, uploading: set[str]) -> str:
        if host.state is HostState.LEFT:
            return "left"
        if host.state is HostState.FINISHED:
            return "finished"
        if host.state is HostState.DROPPED:
            return "gone"
        rounds = self.rounds
        if host.id in uploading:
            return "uploading"
        if host.id in rounds.received:
            return "training" if host.id in rounds.deltas.training else "waiting"
        if rounds.received and rounds.open.missing() == [host.id]:
            return "late"
        return "training"

    def snapshot(self, uploading: set[str] = frozenset()) -> dict:
        """The run now (see the module's docstring); ``uploading``: the hosts whose upload is in flight."""
        state = self.state
        now, clock = time.time(), time.monotonic()
        price = state.config.gpu_hour_price
        hosts = []
        traffic, first, last = 0, float("inf"), 0.0
        for host_id in sorted(state.hosts, key=host_order):  # a relay's own records (upstream): timeline only
            entry = state.hosts[host_id]
            seen = self.hosts.get(host_id) or _Host()
            done = sorted(seen.rounds)
            share = None
            if len(done) >= 2:  # train start of the oldest kept round to that of the newest
                a, b = seen.rounds[done[0]], seen.rounds[done[-1]]
                if a.train_start is not None and b.train_start is not None and b.train_start > a.train_start:
                    trained = sum(seen.rounds[r].train_s for r in done[:-1])
                    share = max(0.0, 1.0 - trained / (b.train_start - a.train_start))
            moved = [seen.rounds[r].bytes for r in done]
            traffic += sum(moved)
            for r in done:
                first, last = min(first, seen.rounds[r].start), max(last, seen.rounds[r].end)
            row = {"id": host_id, "state": self.host_state(entry, uploading), "lease_age_s": clock - entry.seen,
                   "last_round": done[-1] if done else None, "wait_share": share,
                   "bytes_per_round": sum(moved) / len(moved) if moved else None,
                   "loss": seen.loss, "metrics": seen.metrics, "gpus": seen.gpus,
                   "train_s": seen.train_s, "wait_s": seen.wait_s}
            if price is not None:
                row["wait_cost"] = seen.wait_s * seen.gpus / 3600 * price
            hosts.append(row)
        return {
            "name": state.config.name, "state": self.run_state(), "round": state.round,
            "published_round": state.published_round, "model_hash": None if state.model is None else state.model.hash,
            "now": now, "started": self.started, "hosts": hosts,
            "coordinator": self.memory, "link_bytes_per_s": traffic / (last - first) if last > first else None,
            "gpu_hour_price": price,
            "wait_cost": None if price is None else sum(h["wait_cost"] for h in hosts),
            "timeline": self.timeline(),
        }

    def timeline(self) -> dict:
        """The last :data:`TIMELINE` rounds' phases per lane, the coordinator's first: ``{"rounds": [...],
        "lanes": [[lane, [[phase, start, end, round], ...]], ...]}``."""
        kept = sorted({r for h in self.hosts.values() for r in h.rounds} | set(self.coordinator.rounds))
        shown = set(kept[-TIMELINE:])
        lanes = []
        names = sorted(set(self.hosts) | set(self.state.hosts), key=host_order)  # hosts without records too
        for name, entry in [(P.COORDINATOR, self.coordinator), *((h, self.hosts.get(h) or _Host()) for h in names)]:
            lanes.append([name, [[*ph, r] for r, rnd in sorted(entry.rounds.items()) if r in shown
                                 for ph in rnd.phases]])
        return {"rounds": sorted(shown), "lanes": lanes}
