"""The ``--merge async`` part of ``nodeox report``: from the coordinator's ``aggregate`` records (one per round,
with its ``quorum``, the hosts it closed without, ``late``, and the late deltas it merged, ``stale``: host ->
rounds late), how the rounds closed and what each host's lateness cost.

- The rounds that closed without every live host, and the quorum they closed on.
- Per host: the rounds that closed without it, its deltas merged late and their staleness (mean and most).

A run under ``--merge sync`` has no such records and no such part.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from ..core import phases as P
from .columns import aligned
from .summary import host_key


def build(records: list[dict]) -> dict | None:
    """The report's ``merge`` part (None: the run's rounds were not ``--merge async``)."""
    rounds = sorted((r for r in records if r["phase"] == P.AGGREGATE and r["host"] == P.COORDINATOR
                     and "quorum" in r), key=lambda r: r["round"])
    if not rounds:
        return None
    missed: dict[str, int] = defaultdict(int)
    stale: dict[str, list[int]] = defaultdict(list)
    for r in rounds:
        for h in r["late"]:
            missed[h] += 1
        for h, s in r["stale"].items():
            stale[h].append(s)
    hosts = sorted(set(missed) | set(stale), key=host_key)
    return {
        "rounds": len(rounds),
        "without_all": sum(1 for r in rounds if r["late"]),
        "quorum": sorted({r["quorum"] for r in rounds}),
        "late_deltas": sum(len(v) for v in stale.values()),
        "hosts": {h: {"rounds_missed": missed[h], "late_deltas": len(stale[h]),
                      "staleness_mean": statistics.mean(stale[h]) if stale[h] else None,
                      "staleness_max": max(stale[h], default=None)} for h in hosts},
    }


def render(merge: dict) -> list[str]:
    """The lines of the ``merge`` part."""
    quorum = "/".join(map(str, merge["quorum"]))
    lines = [f"async merge: {merge['without_all']} of {merge['rounds']} rounds closed without every live host "
             f"(quorum {quorum}); {merge['late_deltas']} late deltas merged into a later round"]
    if merge["hosts"]:
        rows = [["host", "rounds missed", "late deltas", "staleness mean", "staleness max"]]
        rows += [[h, str(c["rounds_missed"]), str(c["late_deltas"]),
                  "-" if c["staleness_mean"] is None else f"{c['staleness_mean']:.1f}",
                  "-" if c["staleness_max"] is None else str(c["staleness_max"])] for h, c in merge["hosts"].items()]
        lines += ["    " + line for line in aligned(rows, right=True)]
    return lines
