"""Samples lost or repeated per epoch in a run of benchmarks/convergence.py's epoch modes: what the published model
trained, from each host's log of the indices it trained (``host<id>_trained.jsonl``: ``[round, epoch, indices]`` a
step) joined with the deltas the coordinator took (its ``receive`` records of published rounds).

An epoch's samples are the split's indices each once. A sample counts when the round of the step that trained it
took the host's delta and was published. Its epoch: under the data ledger, the ledger's (the epochs end at the
rounds of the ``data`` records' ``epoch_ended``, and no host trains a sample of the next epoch before the round
after); hand-sharded, the host's own Lightning epoch (a host that joined late: counted from host 0's epoch in its
first round). Lost: indices the epoch's counted samples miss; repeated: counted samples beyond the first of each.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from pathlib import Path


def trained(out: Path) -> dict[str, list[tuple[int, int, list[int]]]]:
    """Each host's ``(round, epoch, indices)`` of every step it logged (a line cut by a kill is skipped)."""
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


def taken(events: list[dict]) -> set[tuple[str, int]]:
    """``(host, round)`` of every delta the coordinator took into a round it published."""
    published = {e["round"] for e in events if e["phase"] == "sync_prepare" and e["host"] == "coordinator"}
    return {(str(e["from_host"]), e["round"]) for e in events if e["phase"] == "receive"
            and e["host"] == "coordinator" and e.get("from_host") is not None and e["round"] in published}


def per_epoch(out: Path, events: list[dict], samples: int, ledger: bool, epochs: int) -> list[dict]:
    """``[{"epoch", "lost", "repeated", "trained"}]`` for epochs 0 to ``epochs - 1``."""
    logs, took = trained(out), taken(events)
    ended = sorted(e["round"] for e in events if e["phase"] == "data" and e["host"] == "coordinator"
                   and e.get("epoch_ended") is not None)
    first_epoch = {}  # hand-sharded: each host's epoch 0 in host 0's count (host 0's epoch in its first round)
    zero = logs.get("0", [])
    for h, rows in logs.items():
        start = min((r for r, _, _ in rows), default=0)
        first_epoch[h] = max((e for r, e, _ in zero if r == start), default=0) if h != "0" else 0
    counts = [Counter() for _ in range(epochs)]
    for h, rows in logs.items():
        for round_, epoch, indices in rows:
            if (h, round_) not in took:
                continue
            e = bisect.bisect_left(ended, round_) if ledger else epoch + first_epoch[h]
            if e < epochs:
                counts[e].update(indices)
    return [{"epoch": e, "trained": sum(c.values()), "lost": samples - len(c),
             "repeated": sum(c.values()) - len(c)} for e, c in enumerate(counts)]
