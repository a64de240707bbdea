"""What a run on Ray hands back to the driver: how each host ended (the value its training function returned,
its restarts) and the run's final model."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from .finalmodel import FinalModel


class Ending(str, Enum):
    """How a host's part ended."""

    DONE = "done"  # its training function returned (the run completed with it)
    LATE = "late"  # it came after the run had completed (a host grown too late)
    NOT_STARTED = "not started"  # not running when the run completed: never started, or restarted and not back yet
    FAILED = "failed"  # its function raised, or its actor died more often than max_restarts allows


@dataclass(frozen=True)
class HostResult:
    """Host ``host``'s part: its ending, its function's return value (rank 0's) and how often Ray restarted it;
    ``error`` says why it failed."""

    host: int
    ending: Ending
    value: Any = None
    restarts: int = 0
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    """A run on Ray that completed: each host's part, by host id, and the final model (its hash is the hosts')."""

    hosts: dict[int, HostResult]
    model: FinalModel
    run_dir: Path

    @property
    def failed(self) -> list[int]:
        """The hosts whose part failed (the run completed without them)."""
        return [h for h, r in self.hosts.items() if r.ending is Ending.FAILED]
