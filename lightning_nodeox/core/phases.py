"""The one timing vocabulary of a round, shared by hosts, coordinator, PhaseMonitor and report.

Host phases: ``train`` (from the round's start to its boundary), ``encode``, ``upload``, ``wait`` (training
waits for a sync: the whole long poll without overlap; with overlap only when the previous round's sync has not
arrived by the next boundary), ``poll`` (with overlap: the exchange worker's long poll while training goes on),
``download``, ``apply``, ``verify`` (``sync`` = download + apply + verify), ``fold`` (with overlap: the sync
folded into the live model), ``provide_model`` when the host uploads the initial model at join, and
``fallback_fetch`` when the host fetches the full model (at join too, when its model is not the run's).
Coordinator phases: ``receive`` (per host), ``aggregate``, ``sync_prepare`` (outer step, quantize, apply,
hash), ``model_materialize`` (serving the full model on demand), ``persist`` (writing the run's state after
a round, off the critical path) and ``store`` (with ``--store``: a sync or model written to the store, its bytes
and requests). ``rss`` records are memory samples (with the coordinator's CPU seconds so
far); a ``restart`` record marks where a coordinator resumed the run; a ``data`` record (no duration) says
where the data ledger stands after a published round (its epoch, samples committed: docs/ledger.md).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

TRAIN, ENCODE, UPLOAD, WAIT, POLL, DOWNLOAD, APPLY, VERIFY, FOLD, PROVIDE_MODEL, FALLBACK_FETCH = (
    "train", "encode", "upload", "wait", "poll", "download", "apply", "verify", "fold", "provide_model",
    "fallback_fetch")
HOST_PHASES = (TRAIN, ENCODE, UPLOAD, WAIT, POLL, DOWNLOAD, APPLY, VERIFY, FOLD, PROVIDE_MODEL, FALLBACK_FETCH)
SYNC_PARTS = (DOWNLOAD, APPLY, VERIFY)

RECEIVE, AGGREGATE, SYNC_PREPARE, MODEL_MATERIALIZE, PERSIST, STORE, RSS, RESTART, DATA = (
    "receive", "aggregate", "sync_prepare", "model_materialize", "persist", "store", "rss", "restart", "data")
COORDINATOR_PHASES = (RECEIVE, AGGREGATE, SYNC_PREPARE, MODEL_MATERIALIZE, PERSIST, STORE)
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
