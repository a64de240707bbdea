"""What a soak's run left behind, read back: the rounds the root published, the hosts' final models and ledgers.

- :func:`published`: the root's ``sync_prepare`` records (its own, in its events.jsonl): round -> model hashes;
- :func:`round_check`: rounds published, and those lost (a gap: a round number never published) or redone (one
  round number published with two models); one number published twice with one model is ``republished``;
- :func:`taken_check`: the same from the hosts' side: a round the hosts took with two models, or with one the root
  never published;
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


def round_check(rounds: dict[int, list[str]]) -> dict:
    """Published rounds: how many, the last, and which were lost, redone or republished with the same model."""
    last = max(rounds, default=-1)
    return {"published": len(rounds), "last": last,
            "lost": [r for r in range(last + 1) if r not in rounds],
            "redone": sorted(r for r, hashes in rounds.items() if len(set(hashes)) > 1),
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


def taken_check(books: dict[str, list[list[dict]]], rounds: dict[int, list[str]]) -> dict:
    """Rounds the hosts took with two different models (``taken_twice``), with a model the root never published
    (``not_published``), or with one it published for another round (``relabelled``: a host that fetched the
    run's model keeps the number of the round it waited on)."""
    seen: dict[int, set[str]] = defaultdict(set)
    for starts in books.values():
        for lines in starts:
            for d in lines:
                if "taken" in d and d.get("model_hash"):
                    seen[d["taken"]].add(d["model_hash"])
    every = {h for hashes in rounds.values() for h in hashes}
    return {"taken_twice": sorted(r for r, h in seen.items() if len(h - every) + len(h & set(rounds.get(r, []))) > 1),
            "not_published": sorted(r for r, h in seen.items() if h - every),
            "relabelled": sorted(r for r, h in seen.items() if (h & every) - set(rounds.get(r, [])))}


def finals(out: Path, hosts: list[str]) -> dict[str, dict | None]:
    """Host id -> its final.json (None: it wrote none)."""
    result: dict[str, dict | None] = {}
    for h in hosts:
        path = out / f"host{h}.final.json"
        result[h] = json.loads(path.read_text()) if path.exists() else None
    return result
