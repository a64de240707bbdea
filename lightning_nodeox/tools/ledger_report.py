"""The data ledger's part of ``nodeox report``: from the coordinator's ``data`` records (one per published round,
docs/ledger.md), where the epochs ended and what each host trained.

- Each ended epoch: the round whose publish ended it, and the samples each host had committed in it (the change of
  the host's committed count from the record that ended the epoch before).
- The epoch in progress: samples committed so far, units committed and held.
- Per host, over the run: samples leased, committed, returned (given back uncommitted: it left, or a delta of its
  was refused or cut) and in flight (leased, neither committed nor returned).

A run whose hosts never declared their data has no ``data`` records and no such part.
"""

from __future__ import annotations

from ..core import phases as P
from .columns import aligned
from .summary import host_key


def records_of(records: list[dict]) -> list[dict]:
    """The root coordinator's ``data`` records (a relay's forwarded ones are its site's), in round order."""
    return sorted((r for r in records if r["phase"] == P.DATA and r["host"] == P.COORDINATOR),
                  key=lambda r: r["round"])


def build(records: list[dict]) -> dict | None:
    """The report's ``data`` part (None: the run had no data ledger)."""
    data = records_of(records)
    if not data:
        return None
    epochs, before = [], {}
    for r in data:
        hosts = _ordered(r.get("hosts") or {})
        if r.get("epoch_ended") is not None:
            epochs.append({"epoch": r["epoch_ended"], "ended_round": r["round"],
                           "committed": _since(hosts, before)})
            before = hosts
    last = data[-1]
    hosts = _ordered(last.get("hosts") or {})
    return {
        "rounds": len(data),
        "epochs": epochs,
        "current": {"epoch": last["epoch"], "committed_samples": last["epoch_committed_samples"],
                    "committed_fraction": last["epoch_committed_fraction"],
                    "units_committed": last["units_committed"], "units_held": last["units_held"],
                    "committed": _since(hosts, before)},
        "hosts": {h: {**c, "in_flight": c["leased"] - c["committed"] - c["returned"]} for h, c in hosts.items()},
    }


def _ordered(hosts: dict[str, dict]) -> dict[str, dict]:
    return {h: hosts[h] for h in sorted(hosts, key=host_key)}


def _since(hosts: dict[str, dict], before: dict[str, dict]) -> dict[str, int]:
    """Each host's samples committed since ``before`` (an earlier record's counts)."""
    return {h: c["committed"] - before.get(h, {}).get("committed", 0) for h, c in hosts.items()}


def _per_host(committed: dict[str, int]) -> str:
    return ", ".join(f"host {h} {n}" for h, n in committed.items() if n) or "-"


def render(data: dict) -> list[str]:
    """The lines of the ``data`` part."""
    cur = data["current"]
    lines = [f"data ledger: epoch {cur['epoch']} in progress, {cur['committed_samples']} samples committed "
             f"({cur['committed_fraction']:.0%}; units {cur['units_committed']} committed, {cur['units_held']} held); "
             f"{len(data['epochs'])} epochs ended"]
    for e in data["epochs"]:
        lines.append(f"  epoch {e['epoch']:<4} ended at round {e['ended_round']:<6} samples committed: "
                     f"{_per_host(e['committed'])}")
    if any(cur["committed"].values()):
        lines.append(f"  epoch {cur['epoch']:<4} {'so far':<21} samples committed: {_per_host(cur['committed'])}")
    rows = [["host", "leased", "committed", "returned", "in flight"]]
    rows += [[h, *(str(c[k]) for k in ("leased", "committed", "returned", "in_flight"))]
             for h, c in data["hosts"].items()]
    lines.append("  samples over the run:")
    lines += ["    " + line for line in aligned(rows, right=True)]
    return lines
