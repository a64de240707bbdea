"""The one timing vocabulary of a round, shared by hosts, coordinator, PhaseMonitor and report.

Host phases: ``train`` (from the round's start to its boundary), ``encode``, ``upload``, ``wait`` (until the
sync is ready), ``download``, ``apply``, ``verify`` (``sync`` = download + apply + verify), and
``fallback_fetch`` when the host fetches the full model. Coordinator phases: ``receive`` (per host),
``aggregate``, ``sync_prepare`` (outer step, quantize, apply, hash), ``model_materialize`` (serving the
full model on demand) and ``persist`` (writing the run's state after a round, off the critical path).
``rss`` records are memory samples (with the coordinator's CPU seconds so far); a ``restart`` record marks
where a coordinator resumed the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

TRAIN, ENCODE, UPLOAD, WAIT, DOWNLOAD, APPLY, VERIFY, FALLBACK_FETCH = (
    "train", "encode", "upload", "wait", "download", "apply", "verify", "fallback_fetch")
HOST_PHASES = (TRAIN, ENCODE, UPLOAD, WAIT, DOWNLOAD, APPLY, VERIFY, FALLBACK_FETCH)
SYNC_PARTS = (DOWNLOAD, APPLY, VERIFY)

RECEIVE, AGGREGATE, SYNC_PREPARE, MODEL_MATERIALIZE, PERSIST, RSS, RESTART = (
    "receive", "aggregate", "sync_prepare", "model_materialize", "persist", "rss", "restart")
COORDINATOR_PHASES = (RECEIVE, AGGREGATE, SYNC_PREPARE, MODEL_MATERIALIZE, PERSIST)
COORDINATOR = "coordinator"


def metric_name(phase: str, unit: str = "s") -> str:
    """TensorBoard/JSON name of a phase's duration or bytes, e.g. ``nodeox/encode_s``."""
    return f"nodeox/{phase}_{unit}"


@dataclass
class PhaseRecord:
    """One timed phase of one round on one host (or the coordinator). Times are Unix seconds."""

    round: int
    host: str
    phase: str
    start: float
    end: float
    bytes: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict:
        """A JSON-ready dict (non-finite floats become null: JSON has no NaN)."""
        d = asdict(self)
        extra = d.pop("extra")
        if d["bytes"] is None:
            del d["bytes"]
        d.update({k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in extra.items()})
        return d

    @classmethod
    def from_json(cls, d: dict) -> PhaseRecord:
        known = {"round", "host", "phase", "start", "end", "bytes"}
        return cls(int(d["round"]), str(d["host"]), str(d["phase"]), float(d["start"]), float(d["end"]),
                   None if d.get("bytes") is None else int(d["bytes"]),
                   {k: v for k, v in d.items() if k not in known})


class PhaseLog:
    """Times the phases of one process and hands each finished record to its listeners."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.listeners: list[Callable[[PhaseRecord], None]] = []

    @contextmanager
    def timed(self, round_: int, phase: str, **extra) -> Iterator[PhaseRecord]:
        record = PhaseRecord(round_, self.host, phase, time.time(), 0.0, extra=extra)
        try:
            yield record
        finally:
            record.end = time.time()
            self.emit(record)

    def emit(self, record: PhaseRecord) -> None:
        for listener in self.listeners:
            listener(record)
