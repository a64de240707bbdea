"""Goodput: the share of the hosts' training time that reached the published model, and what each fault cost.

Training time is the hosts' own ``train`` records (benchmarks/soak_host.py's ledger: a round's start to its
boundary, pauses included), plus, for a start that ended without its round's sync (killed), the training it did
since its last round taken (its last batch's end). A host's ``train`` record of round r *reached the model* when
the same start of the host took round r as a contributor, the root published round r, and the root aggregated
the host's delta in it (the host itself, or its relay). Every other second is lost, and charged to the fault
that hit this host (itself, its relay, its link, the root or the root's disk) over the most of that time, from the
fault's start to its end plus ``linger`` seconds (a host comes back a round late); lost time under no fault is
charged to ``none``.
"""

from __future__ import annotations

from collections import defaultdict

from soak_cluster import Topology

SYNC_PHASES = ("download", "apply", "verify", "fold", "fallback_fetch", "provide_model")


def hits(fault: dict, host: str, topology: Topology) -> bool:
    """Whether ``fault`` (an injector's line) touches ``host``."""
    relay = topology.relay_of(host)
    return fault["target"] in (f"host{host}", relay, "root")


def charge(lost: dict[str, float], start: float, end: float, host: str, faults: list[dict], topology: Topology,
           linger: float) -> None:
    """Add ``end - start`` lost seconds of ``host`` to the fault that overlaps them most (else to ``none``)."""
    best, most = "none", 0.0
    for f in faults:
        if f.get("skipped") or not hits(f, host, topology):
            continue
        overlap = min(end, f["end"] + linger) - max(start, f["start"])
        if overlap > most:
            best, most = f["kind"], overlap
    lost[best] += end - start


def unrecorded(lines: list[dict]) -> tuple[float, float] | None:
    """The training a start did after its last round taken that no ``train`` record holds: (from, to), or None."""
    origin = lines[0]["started"]
    last_end = None
    for d in lines:
        if "taken" in d:
            origin, last_end = d["at"], None
        elif d.get("phase") in SYNC_PHASES:
            origin, last_end = max(origin, d["end"]), None
        elif "batch_end" in d:
            last_end = d["batch_end"]
    return (origin, last_end) if last_end is not None and last_end > origin else None


def goodput(books: dict[str, list[list[dict]]], contributors: dict[int, set[str]], published: set[int],
            faults: list[dict], topology: Topology, linger: float) -> dict:
    """``{"goodput", "train_s", "useful_s", "lost_s": {kind: seconds}, "lost_share": {kind: share}}``."""
    useful, total = 0.0, 0.0
    lost: dict[str, float] = defaultdict(float)
    for host, starts in books.items():
        member = topology.relay_of(host) or host
        for lines in starts:
            took = {d["taken"]: d["contributed"] for d in lines if "taken" in d}
            for d in lines:
                if d.get("phase") != "train":
                    continue
                seconds = d["end"] - d["start"]
                total += seconds
                r = d["round"]
                if took.get(r) and r in published and member in contributors.get(r, ()):
                    useful += seconds
                else:
                    charge(lost, d["start"], d["end"], host, faults, topology, linger)
            tail = unrecorded(lines)
            if tail is not None:
                total += tail[1] - tail[0]
                charge(lost, *tail, host, faults, topology, linger)
    return {"goodput": useful / total if total else 0.0, "train_s": total, "useful_s": useful,
            "lost_s": dict(sorted(lost.items())),
            "lost_share": {k: v / total for k, v in sorted(lost.items())} if total else {}}
