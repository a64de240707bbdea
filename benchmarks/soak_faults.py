"""Faults done to a running cluster: each :class:`~soak_schedule.Fault` started at its round and ended after its
hold, one at a time per target, with when each began and ended written as it happens.

A fault whose target is still under another waits for it (``deferred`` rounds in its line); a disk fault without a
mounted disk is not done (``skipped``). ``under_fault`` names the processes that are down on purpose, so that the
soak does not mistake them for failures.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from soak_cluster import Cluster
from soak_disk import Disk
from soak_schedule import Fault


class Injector:
    """Starts and ends faults on ``cluster``; ``write`` gets one dict per fault that ended (and per skip)."""

    def __init__(self, cluster: Cluster, disk: Disk | None, write: Callable[[dict], None]) -> None:
        self.cluster, self.disk, self.write = cluster, disk, write
        self.active: dict[str, tuple[Fault, dict]] = {}  # target -> (fault, its line)
        self.done: list[dict] = []

    def busy(self, fault: Fault) -> bool:
        return fault.target in self.active

    def under_fault(self) -> set[str]:
        """Processes down or stopped on purpose now."""
        return {t for t, (f, _) in self.active.items() if f.kind in ("host_kill", "host_pause", "root_kill",
                                                                     "relay_kill")}

    def start(self, fault: Fault, round_: int) -> None:
        line = {"kind": fault.kind, "target": fault.target, "at_round": fault.at_round, "round": round_,
                "deferred": round_ - fault.at_round, "hold_s": fault.hold_s, "start": time.time()}
        if fault.kind == "disk_full" and self.disk is None:
            self._finish(line, skipped=Disk.unavailable or "no disk mounted")
            return
        c = self.cluster
        if fault.kind in ("host_kill", "root_kill", "relay_kill"):
            c.kill(fault.target)
        elif fault.kind == "host_pause":
            c.pause(fault.target)
        elif fault.kind == "link_cut":
            c.proxies[fault.target.removeprefix("host")].cut(fault.hold_s)
        elif fault.kind == "disk_full":
            assert self.disk is not None
            line["ballast_bytes"] = self.disk.fill()
        self.active[fault.target] = (fault, line)

    def end_due(self, round_: int) -> None:
        """End every fault whose hold is over."""
        now = time.time()
        for target, (fault, line) in list(self.active.items()):
            if now >= line["start"] + fault.hold_s:
                self._end(fault, line, round_)
                del self.active[target]

    def _end(self, fault: Fault, line: dict, round_: int) -> None:
        c = self.cluster
        if fault.kind in ("host_kill", "root_kill", "relay_kill"):
            c.restart(fault.target)
        elif fault.kind == "host_pause":
            c.resume(fault.target)
        elif fault.kind == "disk_full":
            assert self.disk is not None
            self.disk.free()
        line["end_round"] = round_
        self._finish(line)

    def _finish(self, line: dict, skipped: str = "") -> None:
        line["end"] = time.time()
        if skipped:
            line["skipped"] = skipped
        self.done.append(line)
        self.write({"fault": line})
