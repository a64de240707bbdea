"""The run directory: ``events.jsonl`` (every phase record of every host and the coordinator) and
TensorBoard scalars under ``tb/`` (one folder per host, one for the coordinator), with the round as the step.

The coordinator's own phases are ``nodeox/...`` (``nodeox/aggregate_s``); the hosts' phases, as the coordinator
saw them round by round, are ``nodeox_round/...`` (``nodeox_round/wait_s``), so that they never overlay the
``nodeox/...`` curves each host's PhaseMonitor logs against its global step.

Records arrive checked (:mod:`~lightning_nodeox.coordinator.intake`: admitted host ids only, finite numbers);
a line that would still hold NaN or Infinity is not written. Work per record is constant.

A disk that fails (full, unwritable) never stops the run: the failure is logged once, then every minute; lines
that could not be written wait (up to 8 MiB) and follow once writing works, and a line is written whole or not at
all; a TensorBoard writer whose thread died on a write error is closed and made again (a new event file in
its folder) ``RunLog.RETRY_S`` seconds later, and the thread's traceback is not printed."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ..core.logs import Named
from ..core.phases import COORDINATOR, RSS, SYNC_PARTS, PhaseRecord, metric_name
from ..core.trouble import Trouble
from .config import NAME

log = logging.getLogger(__name__)

RSS_METRIC = "nodeox/coordinator_rss_bytes"
HOST_PREFIX = "nodeox_round"
EVENTS_FILE = "events.jsonl"
TB_DIR = "tb"


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


class LineFile:
    """An append-only file of whole lines: a write that fails half-way is cut back to the last whole line, so the
    file never holds part of one. Lines that could not be written wait (up to ``MAX_PENDING`` bytes, the oldest
    dropped beyond it) and go out with the next write that works."""

    MAX_PENDING = 8 << 20

    def __init__(self, path: Path, name: str = NAME) -> None:
        self.path = path
        self.log = Named(log, name)
        self.trouble = Trouble(str(path), name)
        self._fd: int | None = None
        self._end = 0  # the file's size after its last whole line
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def append(self, lines: list[bytes]) -> None:
        self._pending += lines
        self._pending_bytes += sum(len(b) for b in lines)
        lost = 0
        while self._pending_bytes > self.MAX_PENDING and len(self._pending) > 1:
            self._pending_bytes -= len(self._pending.pop(0))
            lost += 1
        try:
            fd = self._open()
            if os.fstat(fd).st_size != self._end:
                os.ftruncate(fd, self._end)  # a failed write's part line (truncating works on a full disk)
            view = memoryview(b"".join(self._pending))
            while view:
                view = view[self._write(fd, view):]
        except OSError as e:
            self.trouble.failed(e, lost)
            if self._fd is not None:
                with contextlib.suppress(OSError):  # else cut at the next write
                    os.ftruncate(self._fd, self._end)
            return
        self._end += self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        self.trouble.lost += lost
        self.trouble.ok()

    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            self._end = _last_line_end(fd, os.fstat(fd).st_size)
            if self._end != os.fstat(fd).st_size:
                self.log.warning("%s ended in part of a line (an earlier crash); cut back to its last "
                                 "whole line", self.path)
            self._fd = fd
        return self._fd

    @staticmethod
    def _write(fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _last_line_end(fd: int, size: int, chunk: int = 1 << 16) -> int:
    """Where the file's last whole line ends (0 if it has none)."""
    pos = size
    while pos > 0:
        start = max(0, pos - chunk)
        data = os.pread(fd, pos - start, start)
        if pos == size and data.endswith(b"\n"):
            return size
        i = data.rfind(b"\n")
        if i >= 0:
            return start + i + 1
        pos = start
    return 0


class RunLog:
    """Appends records to ``events.jsonl`` and writes their durations and bytes as TensorBoard scalars; a disk
    that fails for a while costs records, never the run (both recover once writing works again). ``name``: what
    its lines start with (its run's).

    Records a site relay forwarded (``SITE/HOST``) go to ``events.jsonl`` only: the relay writes their scalars in
    its own run directory, and writing them again here was most of a root's CPU per round behind relays
    (TensorBoard's event writer costs ~80 us a record, pure-Python CRCs on threads of its own)."""

    RETRY_S = 10.0  # how soon a TensorBoard writer that failed is made again

    def __init__(self, run_dir: Path, name: str = NAME) -> None:
        self.run_dir = run_dir
        self.log = Named(log, name)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._events = LineFile(run_dir / EVENTS_FILE, name)
        self._writers: dict[str, object] = {}
        self._retry_at: dict[str, float] = {}  # host -> when its failed TensorBoard writer may be made again
        self._tb_trouble = Trouble(f"{run_dir / TB_DIR}", name)
        self._sync_parts: dict[str, dict[int, dict[str, float]]] = {}  # host -> round -> sync part -> seconds

    def write(self, records: Iterable[PhaseRecord]) -> None:
        lines = []
        for r in records:
            try:
                lines.append(json.dumps(r.to_json(), separators=(",", ":"), allow_nan=False).encode() + b"\n")
            except ValueError:
                self.log.error("a %s record of %s holds a non-finite number; not written", r.phase,
                               r.host)
                continue
            if "/" not in r.host:  # not forwarded by a site relay (see above)
                self._tb(r)
        if lines:
            self._events.append(lines)

    def _tb(self, r: PhaseRecord) -> None:
        """``r``'s scalars; a writer that fails (its thread died on a write error) is closed and made again."""
        writer = self._writer(r.host)
        if writer is None:
            return
        try:
            self._scalars(writer, r)
        except Exception as e:  # noqa: BLE001 - TensorBoard re-raises its writer thread's error on every call
            self._tb_trouble.failed(e, 1)
            self._drop_writer(r.host)
            return
        self._tb_trouble.ok()

    def _scalars(self, writer, r: PhaseRecord) -> None:
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
        if host in self._writers:
            return self._writers[host]
        if time.monotonic() < self._retry_at.get(host, 0.0):
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter

            from ..core.eventfiles import quiet_writer_threads
        except ImportError:  # tensorboard missing: events.jsonl still has everything
            log.warning("nodeox: tensorboard is not installed; %s/%s is not written", self.run_dir, TB_DIR)
            self._writers[host] = None
            return None
        quiet_writer_threads()  # a writer thread's failure is said here, once (see _tb), not as its traceback
        try:
            self._writers[host] = SummaryWriter(str(self.run_dir / TB_DIR / tb_folder(host)))
        except OSError as e:
            self._tb_trouble.failed(e, 1)
            self._retry_at[host] = time.monotonic() + self.RETRY_S
            return None
        return self._writers[host]

    def _drop_writer(self, host: str) -> None:
        writer = self._writers.pop(host, None)
        self._retry_at[host] = time.monotonic() + self.RETRY_S
        with contextlib.suppress(Exception):  # a dead writer may raise its error again while closing
            writer.close()

    def flush(self) -> None:
        for host, w in list(self._writers.items()):
            if w is not None:
                try:
                    w.flush()
                except Exception as e:  # noqa: BLE001 - see _tb
                    self._tb_trouble.failed(e)
                    self._drop_writer(host)

    def close(self) -> None:
        self.flush()
        self._events.close()
        for host in [h for h, w in self._writers.items() if w is not None]:
            self._drop_writer(host)
