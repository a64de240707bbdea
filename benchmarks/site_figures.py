"""The figures of benchmarks/sites.py, pure: per-round times and link timelines in, numbers and goals out.

Shared by the nodeox placements (benchmarks/sites.py) and the torchft one (benchmarks/sites_torchft.py), so both
are measured by one rule; benchmarks/peers.py measures its rounds by the same rule (its own goals:
benchmarks/peers_figures.py). A round's times are the LAST participant's: ``sent`` (its delta left it), ``applied``
(its sync applied) and ``done`` (its exchange over: for nodeox the verify end, for torchft the step's end).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

SITES, HOSTS_PER_SITE = 2, 4
GOAL_ROUND_SPEEDUP = 2.0  # round time, flat / relays
METRICS = ("far_bytes", "delta_to_sync_s", "round_s")
MEMORY_FLOOR = int(1.5 * 2**30)  # bytes of MemAvailable below which a run is stopped
Timeline = list[tuple[float, int]]  # (wall time, bytes so far), in time order


class PlacementFailed(RuntimeError):
    """A placement could not run; the message says which part and why."""


class PlacementSkipped(RuntimeError):
    """A placement that cannot run here (torchft not installed, ...); the message says why."""


def sent_between(timeline: Timeline, start: float, end: float) -> int:
    """Bytes a counter's ``timeline`` gained in the wall-clock window (start, end]: the last sample at or before
    each end (0 before the first)."""
    before = after = 0
    for stamp, total in timeline:
        if stamp <= start:
            before = total
        if stamp <= end:
            after = total
    return after - before


def mem_available() -> int:
    """The machine's MemAvailable in bytes (what a run's processes take shows as its drop; not pure)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def check_memory(memory: dict, floor: int = MEMORY_FLOOR) -> None:
    """Note the lowest MemAvailable in ``memory``; raise PlacementFailed below ``floor`` (the machine is shared:
    a run that would exhaust it is stopped, not left to the OOM killer)."""
    now = mem_available()
    memory["min_available"] = min(memory.get("min_available", now), now)
    if now < floor:
        raise PlacementFailed(f"MemAvailable fell to {now / 2**30:.1f} GiB (below {floor / 2**30:.1f} GiB): "
                              "stopped; this placement does not fit in this machine's memory now")


def nodeox_times(records: list[dict]) -> dict[tuple[int, str], float]:
    """``(round, sent|applied|done) -> time`` of the last synthetic host (ids are digits; behind a relay the root
    holds them as ``SITE/ID``): its upload end, apply end and verify end."""
    what = {"upload": "sent", "apply": "applied", "verify": "done"}
    last: dict[tuple[int, str], float] = {}
    for r in records:
        if r["phase"] in what and str(r["host"]).rpartition("/")[2].isdigit():
            key = (r["round"], what[r["phase"]])
            last[key] = max(last.get(key, float("-inf")), r["end"])
    return last


def root_payload(records: list[dict]) -> dict[int, int]:
    """Per round, the delta and sync bodies over the root's own links (its hosts' or relays' upload and download
    bytes, as their records say): what the far links carry besides HTTP framing, heartbeats and records."""
    out: dict[int, int] = {}
    for r in records:
        if r["phase"] in ("upload", "download") and "/" not in str(r["host"]) and r["host"] != "coordinator":
            out[r["round"]] = out.get(r["round"], 0) + r.get("bytes", 0)
    return out


def latest_times(per_process: list[list[dict]]) -> dict[tuple[int, str], float]:
    """``(round, sent|applied|done) -> time`` of the last process, from each process's own per-round records
    (``{"round", "sent", "applied", "done"}``, as torchft's replicas and the DDP workers write them)."""
    last: dict[tuple[int, str], float] = {}
    for rounds in per_process:
        for r in rounds:
            for what in ("sent", "applied", "done"):
                last[(r["round"], what)] = max(last.get((r["round"], what), float("-inf")), r[what])
    return last


def per_round(last: dict[tuple[int, str], float], far_sent_between: Callable[[float, float], float] | None = None,
              *, windows: dict[str, Callable[[float, float], float]] | None = None) -> list[dict]:
    """Per round from round 1 on (round 0 pays for the model's first transfer): far bytes in the window from the
    round before's ``done`` to this round's (``far_sent_between(start, end)``; and so each of ``windows``, by its
    name), delta to sync (``applied`` - ``sent``) and the round time (``done`` - the round before's ``done``)."""
    counted = ({"far_bytes": far_sent_between} if far_sent_between is not None else {}) | (windows or {})
    out = []
    for rnd in sorted({rnd for rnd, what in last if what == "done"}):
        if rnd == 0 or any(k not in last for k in ((rnd - 1, "done"), (rnd, "sent"), (rnd, "applied"))):
            continue
        start, end = last[(rnd - 1, "done")], last[(rnd, "done")]
        out.append({"round": rnd, **{name: count(start, end) for name, count in counted.items()},
                    "delta_to_sync_s": last[(rnd, "applied")] - last[(rnd, "sent")], "round_s": end - start})
    return out


def run_figures(rounds: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """One run: the median over its rounds of each of ``metrics`` that every round has."""
    return {m: statistics.median(r[m] for r in rounds) for m in metrics if all(m in r for r in rounds)} \
        if rounds else {}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def placement_figures(runs: list[dict], metrics: tuple[str, ...] = METRICS) -> dict:
    """Over runs: median and range of the runs' medians, per metric (of ``metrics``, those every run has)."""
    return {m: spread([run[m] for run in runs]) for m in metrics if runs and all(m in run for run in runs)}


def goals(figures: dict[str, dict], hosts_per_site: int = HOSTS_PER_SITE,
          speedup: float = GOAL_ROUND_SPEEDUP) -> list[dict]:
    """The goals, met or not, from the placements' figures (a goal whose placements did not run is left out)."""
    out = []
    flat, relays, peers = figures.get("flat"), figures.get("relays"), figures.get("torchft")

    def ratio(goal: str, a: dict, b: dict, metric: str, at_least: float, names: tuple[str, str]) -> dict:
        measured = a[metric]["median"] / b[metric]["median"]
        return {"goal": goal, "measured": measured, "met": measured >= at_least,
                names[0]: a[metric]["median"], names[1]: b[metric]["median"]}

    if flat and relays:
        out.append(ratio(f"far bytes per round cut >= {hosts_per_site}x (hosts per site) by relays, flat / relays",
                         flat, relays, "far_bytes", hosts_per_site, ("flat", "relays")))
        out.append(ratio(f"relay placement's round >= {speedup:g}x faster than flat, flat / relays",
                         flat, relays, "round_s", speedup, ("flat", "relays")))
    if relays and peers:
        out.append(ratio("nodeox relays' round faster than torchft fp32 DiLoCo's, torchft / relays",
                         peers, relays, "round_s", 1.0, ("torchft", "relays")))
        out.append(ratio("nodeox relays move fewer far bytes than torchft fp32 DiLoCo, torchft / relays",
                         peers, relays, "far_bytes", 1.0, ("torchft", "relays")))
    return out
