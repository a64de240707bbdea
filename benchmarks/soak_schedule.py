"""The soak's faults, drawn from a seed: what happens, to whom, at which round, and for how long.

A fault starts when the root reports its round (progress, not a clock); it ends after ``hold_s`` seconds, since
what it must outlast (a host's lease) is a time. Kinds:

- ``host_kill``: kill -9 a host, start it again with its id once its lease has expired (before, the id is in use);
- ``host_pause``: SIGSTOP a host past its lease, then SIGCONT;
- ``root_kill``: kill -9 the root coordinator, start it again on its run directory and port;
- ``relay_kill``: kill -9 a relay, start it again on its port once its lease upstream has expired;
- ``link_cut``: a relay's link to the root, or a direct host's, down for longer than the lease;
- ``disk_full``: the root's run directory (a tmpfs) filled to the last byte, then freed.

Several faults may start at one round (``overlap``): a fault drawn with another already under way, on another
target. Faults end a few rounds before the run's last round so that the run ends whole.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from soak_cluster import Topology

KINDS = ("host_kill", "host_pause", "root_kill", "relay_kill", "link_cut", "disk_full")


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` on ``target`` (a process or link name: ``host3``, ``relay0``, ``root``) from round
    ``at_round`` for ``hold_s`` seconds."""

    kind: str
    target: str
    at_round: int
    hold_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def hold(kind: str, lease: float, rng: random.Random) -> float:
    """How long a fault of ``kind`` lasts: past the lease where the lease is what it tests."""
    if kind in ("host_kill", "relay_kill"):
        return lease + 1.0  # until the id is free again
    if kind in ("host_pause", "link_cut"):
        return lease * rng.uniform(1.5, 2.5)
    if kind == "root_kill":
        return rng.uniform(0.2, 2.0)
    return rng.uniform(2.0, 4.0) * lease  # disk_full


def targets(kind: str, topology: Topology) -> list[str]:
    """Whom a fault of ``kind`` can hit."""
    if kind in ("host_kill", "host_pause"):
        return [f"host{h}" for h in topology.hosts]
    if kind == "relay_kill":
        return topology.relay_names
    if kind == "link_cut":
        return [*topology.relay_names, *(f"host{h}" for h in topology.hosts if topology.relay_of(h) is None)]
    return ["root"]


def draw(seed: int, rounds: int, topology: Topology, lease: float, kinds: tuple[str, ...] = KINDS, *,
         every: tuple[int, int] = (2, 6), overlap: float = 0.3, first: int = 3, quiet_end: int = 5) -> list[Fault]:
    """Faults for a run of ``rounds`` rounds: one every ``every`` rounds (drawn), each of ``kinds`` at least once
    (they come first, in a drawn order), a second fault at the same round with probability ``overlap``; none
    before round ``first`` or in the last ``quiet_end`` rounds."""
    rng = random.Random(seed)
    kinds = tuple(k for k in kinds if targets(k, topology))
    must = rng.sample(kinds, len(kinds))
    faults: list[Fault] = []
    r = first
    while r < rounds - quiet_end:
        at_once = 2 if rng.random() < overlap else 1
        taken: set[str] = set()
        for _ in range(at_once):
            kind = must.pop() if must else rng.choice(kinds)
            free = [t for t in targets(kind, topology) if t not in taken]
            if not free:
                continue
            target = rng.choice(free)
            taken.add(target)
            faults.append(Fault(kind, target, r, round(hold(kind, lease, rng), 2)))
        r += rng.randint(*every)
    return faults
