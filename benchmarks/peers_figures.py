"""The figures and goals of benchmarks/peers.py, pure: a run's records and the runs' figures in, numbers out.

Rounds are measured by benchmarks/site_figures.py's rule (the last host's times); here: nodeox's phases (the
slowest host's), its payload (what one transfer of a round moves), and the goals against torchft.
"""

from __future__ import annotations

import statistics

from site_figures import spread

HOST_PHASES = ("encode", "upload", "wait", "download", "apply", "verify")
COORDINATOR_PHASES = ("aggregate", "sync_prepare")
METRICS = ("round_s", "delta_to_sync_s", "up_bytes", "down_bytes", "payload_bytes")
GOAL_UNLIMITED = 0.5  # nodeox's round / torchft's sync, on an unlimited link
GOAL_LIMITED = 0.25  # the same on a limited one
GOAL_FLOOR = 1.3  # nodeox's round / one transfer of its payload over the link
FLOOR_AT_MBIT = 200.0  # the floor goal is for links this slow or slower (where the link, not the CPU, should bound)


def link_label(mbit: float | None) -> str:
    return "unlimited" if mbit is None else f"{mbit:g} Mbit/s"


def is_host(name: object) -> bool:
    """A synthetic host's record (ids are digits), not the coordinator's."""
    return str(name).isdigit()


def slowest_phases(records: list[dict]) -> dict[str, float]:
    """Per phase, the median over rounds (round 0 left out) of the slowest host's time in it (a host's records of
    one phase in one round summed), or the coordinator's for its phases; a phase no round has is left out."""
    took: dict[tuple[str, int, str], float] = {}  # (phase, round, host) -> seconds
    for r in records:
        wanted = (r["phase"] in HOST_PHASES and is_host(r["host"])) or \
            (r["phase"] in COORDINATOR_PHASES and r["host"] == "coordinator")
        if wanted and r["round"] > 0:
            key = (r["phase"], r["round"], str(r["host"]))
            took[key] = took.get(key, 0.0) + r["end"] - r["start"]
    slowest: dict[str, dict[int, float]] = {}
    for (phase, rnd, _), seconds in took.items():
        per = slowest.setdefault(phase, {})
        per[rnd] = max(per.get(rnd, 0.0), seconds)
    return {p: statistics.median(slowest[p].values()) for p in (*HOST_PHASES, *COORDINATOR_PHASES) if p in slowest}


def host_payload(records: list[dict]) -> dict[int, int]:
    """Per round, the largest body one host moved one way (its delta up or its sync down, as its records say):
    what one transfer of the round carries over a host's link."""
    out: dict[int, int] = {}
    for r in records:
        if r["phase"] in ("upload", "download") and is_host(r["host"]):
            out[r["round"]] = max(out.get(r["round"], 0), r.get("bytes") or 0)
    return out


def critical_path(events: list[dict], r: int) -> dict[str, float]:
    """Round ``r`` cut where its last delta was in, its sync's last piece made and its sync's last byte at the last
    host: each part is the time the round still waited on that stage once the one before had ended; with the round
    (first encode start to last verify end), they add up to it."""

    def last(phase: str, host=str.isdigit) -> float:
        return max(e["end"] for e in events if e["round"] == r and e["phase"] == phase and host(str(e["host"])))

    start = min(e["start"] for e in events if e["round"] == r and e["phase"] == "encode")
    delta_in, sync_made = last("upload"), last("sync_prepare", lambda h: h == "coordinator")
    sync_out, verified = last("download"), last("verify")
    return {"round": verified - start, "delta_in": delta_in - start, "sync_made": sync_made - delta_in,
            "sync_out": sync_out - sync_made, "verified": verified - sync_out}


def phase_figures(runs: list[dict]) -> dict[str, dict]:
    """Over runs: median and range of each phase's run median (phases every run has)."""
    phases = [p for p in (*HOST_PHASES, *COORDINATOR_PHASES) if runs and all(p in run["phases"] for run in runs)]
    return {p: spread([run["phases"][p] for run in runs]) for p in phases}


def _ratio(goal: str, a: dict, b: dict, at_most: float) -> dict:
    """``a`` / ``b`` (spreads) against ``at_most``: the ratio of medians, and its range over the runs."""
    measured = a["median"] / b["median"]
    return {"goal": goal, "measured": measured, "range": [a["min"] / b["max"], a["max"] / b["min"]],
            "met": measured <= at_most}


def goals(figures: dict[str, dict[str, dict]], rates: dict[str, float | None]) -> list[dict]:
    """The goals, met or not: per link (``figures``: link label -> placement -> its figures; ``rates``: link
    label -> Mbit/s, None for unlimited), nodeox's round against torchft's sync, and on slow links nodeox's round
    against one transfer of its payload (the duplex floor: up and down at once, not one after the other). A goal
    whose placements did not run (or whose figure was not measured) is left out."""
    out = []
    for link, placements in figures.items():
        mbit = rates[link]
        nodeox, torchft = placements.get("nodeox", {}), placements.get("torchft", {})
        if "round_s" in nodeox and "delta_to_sync_s" in torchft:
            limit = GOAL_UNLIMITED if mbit is None else GOAL_LIMITED
            out.append(_ratio(f"{link}: nodeox's round <= {limit:g}x torchft DiLoCo's sync", nodeox["round_s"],
                              torchft["delta_to_sync_s"], limit))
        if mbit is not None and mbit <= FLOOR_AT_MBIT and "round_s" in nodeox and "payload_bytes" in nodeox:
            floor_s = nodeox["payload_bytes"]["median"] * 8 / (mbit * 1e6)
            out.append(_ratio(f"{link}: nodeox's round <= {GOAL_FLOOR:g}x one transfer of its payload "
                              f"({floor_s:.2f} s)", nodeox["round_s"], spread([floor_s]), GOAL_FLOOR))
    return out
