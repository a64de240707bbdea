"""Samples lost or repeated per epoch in a run of benchmarks/convergence.py's epoch modes: what the published model
trained, from each host's log of the indices it trained (``host<id>_trained.jsonl``: ``[round, epoch, indices,
time]`` a step, its time before the step) joined with the deltas the coordinator took into published rounds.

An epoch's samples are the split's indices each once. A step's samples count when the delta that carried them
(the coordinator's first ``receive`` of the host's delta of that round after the step) went into a round that was
published and kept (not when the host's own ``upload`` record of it says ``rejected``: the coordinator then
receives the empty delta the host sends in its place; a killed host's last records may be missing, so the
receive decides otherwise): a coordinator restarted from its saved state (a ``restart`` record) forgets the rounds its
previous life published from the first round it publishes itself on (a round whose model a host gave back, its save
not on disk, is kept; one it publishes again is not). A sample's epoch: under the data
ledger, the ledger's (the epochs end at the rounds of the ``data`` records' ``epoch_ended``, and no host trains a
sample of the next epoch before the round after); hand-sharded, the host's own Lightning epoch (a host that joined
late: counted from host 0's epoch in its first round). Lost: indices the epoch's counted samples miss; repeated:
counted samples beyond the first of each.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from pathlib import Path


def trained(out: Path) -> dict[str, list[tuple[int, int, list[int], float]]]:
    """Each host's ``(round, epoch, indices, time)`` of every step it logged (a line cut by a kill is skipped)."""
    hosts = {}
    for path in sorted(out.glob("host*_trained.jsonl")):
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(tuple(json.loads(line)))
            except json.JSONDecodeError:
                continue
        hosts[path.name.removeprefix("host").removesuffix("_trained.jsonl")] = rows
    return hosts


class Published:
    """Which of the coordinator's receives went into the published model, across its restarts."""

    def __init__(self, events: list[dict]) -> None:
        own = [e for e in events if e["host"] == "coordinator"]
        restarts = sorted((e["start"], e["round"]) for e in own if e["phase"] == "restart")
        self._starts = [t for t, _ in restarts]
        self._published = {(self._life(e["end"]), e["round"]) for e in own if e["phase"] == "sync_prepare"}
        # life k + 1 went on from this round: the first it published (a host may have given back the model of a
        # round its save had not reached: that round is kept), else the round its restart record says it resumed at
        self._resumed = [min((r for life, r in self._published if life == k + 1), default=resumed)
                         for k, (_, resumed) in enumerate(restarts)]
        self._receives: dict[tuple[str, int], list[float]] = defaultdict(list)
        for e in own:
            if e["phase"] == "receive" and e.get("from_host") is not None:
                self._receives[(str(e["from_host"]), e["round"])].append(e["end"])
        for times in self._receives.values():
            times.sort()
        self._uploads: dict[tuple[str, int], list[tuple[float, bool]]] = defaultdict(list)  # (start, refused)
        for e in events:
            if e["phase"] == "upload" and e["host"] != "coordinator" and not e.get("empty"):
                self._uploads[(str(e["host"]), e["round"])].append((e["start"], bool(e.get("rejected"))))
        for uploads in self._uploads.values():
            uploads.sort()

    def _life(self, t: float) -> int:
        return bisect.bisect_right(self._starts, t)

    def kept(self, record: dict) -> bool:
        """Whether a record of the coordinator's is of a round its run kept (not forgotten by a restart after it)."""
        life = self._life(record["end"])
        return life == len(self._resumed) or record["round"] < self._resumed[life]

    def counts(self, host: str, round_: int, at: float) -> bool:
        """Whether a step of ``host`` in round ``round_`` trained at ``at`` reached the published model."""
        sent = next((refused for start, refused in self._uploads.get((host, round_), []) if start >= at), False)
        if sent:  # its delta was refused (the empty delta the host then sends in its place is not it)
            return False
        times = self._receives.get((host, round_), [])
        k = bisect.bisect_left(times, at)
        if k == len(times):
            return False  # never taken
        life = self._life(times[k])
        return (life, round_) in self._published and self.kept({"round": round_, "end": times[k]})


def per_epoch(out: Path, events: list[dict], samples: int, ledger: bool, epochs: int) -> list[dict]:
    """``[{"epoch", "lost", "repeated", "trained"}]`` for epochs 0 to ``epochs - 1``."""
    logs, published = trained(out), Published(events)
    ended = sorted(e["round"] for e in events if e["phase"] == "data" and e["host"] == "coordinator"
                   and e.get("epoch_ended") is not None and published.kept(e))
    first_epoch = {}  # hand-sharded: each host's epoch 0 in host 0's count (host 0's epoch in its first round)
    zero = logs.get("0", [])
    for h, rows in logs.items():
        start = min((row[0] for row in rows), default=0)
        first_epoch[h] = max((row[1] for row in zero if row[0] == start), default=0) if h != "0" else 0
    counts = [Counter() for _ in range(epochs)]
    for h, rows in logs.items():
        for round_, epoch, indices, at in rows:
            if not published.counts(h, round_, at):
                continue
            e = bisect.bisect_left(ended, round_) if ledger else epoch + first_epoch[h]
            if e < epochs:
                counts[e].update(indices)
    return [{"epoch": e, "trained": sum(c.values()), "lost": samples - len(c),
             "repeated": sum(c.values()) - len(c)} for e, c in enumerate(counts)]


def ledger_disagreements(out: Path, events: list[dict]) -> dict[tuple[str, int], tuple[int, int]]:
    """Under the data ledger, a check of the time join above against the authority: ``{(host, round): (counted,
    ledger's)}`` where the samples this module counts for a host's step in a kept published round differ from the
    coordinator's ``data`` record's ``deltas`` for it (the samples of that host's delta the round took). Empty when
    they agree."""
    published = Published(events)
    ledger = Counter()
    for e in events:
        if e["host"] == "coordinator" and e["phase"] == "data" and published.kept(e):
            for h, n in (e.get("deltas") or {}).items():
                ledger[(str(h), e["round"])] = n  # a round's last kept record (a restart's retake replaces it)
    counted = Counter()
    for h, rows in trained(out).items():
        for round_, _, indices, at in rows:
            if published.counts(h, round_, at):
                counted[(h, round_)] += len(indices)
    return {k: (counted[k], ledger[k]) for k in sorted(set(counted) | set(ledger)) if counted[k] != ledger[k]}
