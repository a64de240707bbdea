"""What a soak's run left behind, read back: the rounds the root published, the hosts' final models and ledgers.

- :func:`published`: the root's ``sync_prepare`` records (its own, in its events.jsonl): round -> model hashes;
- :func:`taken`: the models the hosts took as each round's result (their ledgers);
- :func:`round_check`: from both, the rounds published, lost (never published) or redone (two models);
- :func:`finals`: each host's final model hash and held-out accuracy (benchmarks/soak_host.py's final.json);
- :func:`ledgers`: each host's ledger lines (benchmarks/soak_host.py), split into its starts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from common import read_events


def published(root_dir: Path) -> dict[int, list[str]]:
    """Round -> the model hashes the root published for it, in order."""
    out: dict[int, list[str]] = defaultdict(list)
    for e in read_events(root_dir):
        if e.get("host") == "coordinator" and e.get("phase") == "sync_prepare":
            out[e["round"]].append(e["model_hash"])
    return dict(out)


def contributors(root_dir: Path) -> dict[int, set[str]]:
    """Round -> the root's members (direct hosts, relays) whose deltas it aggregated."""
    out: dict[int, set[str]] = {}
    for e in read_events(root_dir):
        if e.get("host") == "coordinator" and e.get("phase") == "aggregate":
            hosts = e["hosts"]
            out[e["round"]] = set(hosts.split(",") if isinstance(hosts, str) else hosts)
    return out


def round_check(rounds: dict[int, list[str]], taken: dict[int, set[str]]) -> dict:
    """Rounds published by the root's records (``rounds``) and as the hosts took them (``taken``): how many, the
    last; ``lost``: a round number neither published nor taken; ``redone``: a round published or taken with two
    models (a model the root's records lack counts: its records of a disk outage die with it when it is killed);
    ``unrecorded``: taken by hosts but missing from the root's records; ``relabelled``: taken with a model the
    root published for another round (a host that fetched the run's model keeps the round it waited on);
    ``republished``: published twice with one model."""
    every = {h for hashes in rounds.values() for h in hashes}
    last = max([*rounds, *taken], default=-1)

    def models(r: int) -> set[str]:
        return set(rounds.get(r, [])) | (taken.get(r, set()) - every)

    return {"published": len(rounds), "last": last,
            "lost": [r for r in range(last + 1) if r not in rounds and r not in taken],
            "redone": [r for r in range(last + 1) if len(models(r)) > 1],
            "unrecorded": [r for r in range(last + 1) if r not in rounds and r in taken],
            "relabelled": sorted(r for r, h in taken.items() if (h & every) - set(rounds.get(r, []))),
            "republished": sorted(r for r, hashes in rounds.items() if len(hashes) > 1 and len(set(hashes)) == 1)}


def ledgers(out: Path) -> dict[str, list[list[dict]]]:
    """Host id -> its starts, each the ledger lines it wrote (the first line of each: ``{"started", "pid"}``)."""
    result: dict[str, list[list[dict]]] = {}
    for path in sorted(out.glob("host*.ledger.jsonl")):
        host = path.name.removeprefix("host").split(".")[0]
        starts: list[list[dict]] = []
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue  # the last line of a host killed while writing it
            if "started" in d:
                starts.append([])
            if starts:
                starts[-1].append(d)
        result[host] = starts
    return result


def taken(books: dict[str, list[list[dict]]]) -> dict[int, set[str]]:
    """Round -> the models the hosts took as its result (their ledgers)."""
    seen: dict[int, set[str]] = defaultdict(set)
    for starts in books.values():
        for lines in starts:
            for d in lines:
                if "taken" in d and d.get("model_hash"):
                    seen[d["taken"]].add(d["model_hash"])
    return dict(seen)


def finals(out: Path, hosts: list[str]) -> dict[str, dict | None]:
    """Host id -> its final.json (None: it wrote none)."""
    result: dict[str, dict | None] = {}
    for h in hosts:
        path = out / f"host{h}.final.json"
        result[h] = json.loads(path.read_text()) if path.exists() else None
    return result
