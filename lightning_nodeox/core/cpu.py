"""How many CPU threads this process is really granted: cgroup quota and affinity, never os.cpu_count()."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_v2_quota(root: Path) -> float | None:
    """CPUs allowed by cgroup v2 ``cpu.max`` ("max 100000" means unlimited)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return int(quota) / int(period)


def _cgroup_v1_quota(root: Path) -> float | None:
    """CPUs allowed by cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 means unlimited)."""
    for folder in (root / "cpu", root / "cpu,cpuacct", root):
        try:
            quota = int((folder / "cpu.cfs_quota_us").read_text())
            period = int((folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota <= 0 else quota / period
    return None


def granted_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """Whole CPUs this process may use: the smaller of its affinity set and its cgroup quota, at least 1."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = os.cpu_count() or 1
    quota = _cgroup_v2_quota(cgroup_root)
    if quota is None:
        quota = _cgroup_v1_quota(cgroup_root)
    allowed = affinity if quota is None else min(affinity, max(1, math.floor(quota)))
    return max(1, allowed)


def choose_threads(requested: int | None, *, purpose: str) -> int:
    """The thread count for ``purpose``: ``requested`` when given, else the granted CPUs; the choice is logged."""
    granted = granted_cpus()
    if requested is not None:
        if requested < 1:
            raise ValueError(f"{purpose} threads must be at least 1, got {requested}")
        log.info("nodeox: %s uses %s (set explicitly; %d CPUs granted)", purpose, _threads(requested), granted)
        return requested
    log.info("nodeox: %s uses %s (CPU quota and affinity of this process)", purpose, _threads(granted))
    return granted


def _threads(n: int) -> str:
    return "1 thread" if n == 1 else f"{n} threads"
