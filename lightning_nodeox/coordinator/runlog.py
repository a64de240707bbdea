"""The run directory: ``events.jsonl`` (every phase record of every host and the coordinator) and
TensorBoard scalars under ``tb/`` (one folder per host, one for the coordinator), with the round as the step.

The coordinator's own phases are ``nodeox/...`` (``nodeox/aggregate_s``); the hosts' phases, as the coordinator
saw them round by round, are ``nodeox_round/...`` (``nodeox_round/wait_s``), so that they never overlay the
``nodeox/...`` curves each host's PhaseMonitor logs against its global step.

Records arrive checked (:mod:`~lightning_nodeox.coordinator.intake`: admitted host ids only, finite numbers);
a line that would still hold NaN or Infinity is not written. Work per record is constant."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

from ..core.phases import COORDINATOR, RSS, SYNC_PARTS, PhaseRecord, metric_name

log = logging.getLogger(__name__)

RSS_METRIC = "nodeox/coordinator_rss_bytes"
HOST_PREFIX = "nodeox_round"


def tag(host: str, phase: str, unit: str = "s") -> str:
    """The TensorBoard tag of a phase's seconds or bytes in the run directory (see the module's docstring)."""
    name = metric_name(phase, unit)
    return name if host == COORDINATOR else name.replace("nodeox/", HOST_PREFIX + "/", 1)


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Highest resident set size this process has had (Linux reports KiB)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (ImportError, OSError):
        return 0


def tb_folder(host: str) -> str:
    return "coordinator" if host == COORDINATOR else f"host_{host}"  # ids are [A-Za-z0-9_.-]


class RunLog:
    """Appends records to ``events.jsonl`` and writes their durations and bytes as TensorBoard scalars."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._events = open(run_dir / "events.jsonl", "a", encoding="utf-8")
        self._writers: dict[str, object] = {}
        self._sync_parts: dict[str, dict[int, dict[str, float]]] = {}  # host -> round -> sync part -> seconds

    def write(self, records: Iterable[PhaseRecord]) -> None:
        lines = []
        for r in records:
            try:
                lines.append(json.dumps(r.to_json(), separators=(",", ":"), allow_nan=False))
            except ValueError:
                log.error("nodeox coordinator: a %s record of %s holds a non-finite number; not written", r.phase,
                          r.host)
                continue
            self._scalars(r)
        if lines:
            self._events.write("\n".join(lines) + "\n")
            self._events.flush()

    def _scalars(self, r: PhaseRecord) -> None:
        writer = self._writer(r.host)
        if writer is None:
            return
        if r.phase == RSS:
            writer.add_scalar(RSS_METRIC, r.extra.get("rss_bytes", 0), r.round, walltime=r.end)
            return
        writer.add_scalar(tag(r.host, r.phase), r.seconds, r.round, walltime=r.end)
        if r.bytes is not None:
            writer.add_scalar(tag(r.host, r.phase, "bytes"), r.bytes, r.round, walltime=r.end)
        error = r.extra.get("q4_rel_error")
        if isinstance(error, (int, float)) and math.isfinite(error):
            writer.add_scalar(f"{HOST_PREFIX}/q4_rel_error", error, r.round, walltime=r.end)
        if r.phase in SYNC_PARTS:
            rounds = self._sync_parts.setdefault(r.host, {})
            parts = rounds.setdefault(r.round, {})
            parts[r.phase] = r.seconds
            if len(parts) == len(SYNC_PARTS):
                writer.add_scalar(tag(r.host, "sync"), sum(parts.values()), r.round, walltime=r.end)
                del rounds[r.round]
            if len(rounds) > 3:  # rounds whose sync never completed (a fallback fetch instead): keep the last 3
                del rounds[min(rounds)]

    def _writer(self, host: str):
        if host not in self._writers:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writers[host] = SummaryWriter(str(self.run_dir / "tb" / tb_folder(host)))
            except ImportError:  # tensorboard missing: events.jsonl still has everything
                log.warning("nodeox: tensorboard is not installed; %s/tb is not written", self.run_dir)
                self._writers[host] = None
        return self._writers[host]

    def flush(self) -> None:
        self._events.flush()
        for w in self._writers.values():
            if w is not None:
                w.flush()

    def close(self) -> None:
        self.flush()
        self._events.close()
        for w in self._writers.values():
            if w is not None:
                w.close()
