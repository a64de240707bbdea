"""How a host's ``fit`` ends when it does not end with the run: the run had completed before it (a second ``fit``
in one script), or the coordinator stopped answering before the run completed (as far as this host knows: one paused past the run's end
is told where the final model is). Both raise at once with what the
host knows (the run's last round and model, or where this host stood) and what to do next, so that a host process
exits 0 only when its run completed (a second ``fit``'s message is all its process prints: no traceback).

A process remembers the runs it saw complete, by coordinator URL: a later ``fit`` against one whose coordinator no
longer answers (it exits once its run is complete) fails at once instead of retrying for ``retry_for`` seconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..core.protocol import Unreachable


class RunCompleted(SystemExit):
    """``fit`` against a run that has completed: a run does not go on after it completes. A ``SystemExit``: left
    uncaught, it ends the process with its message alone (no traceback under it) and exit status 1; a script that
    fits again on purpose catches ``RunCompleted``."""


class RunNotCompleted(Unreachable):
    """The coordinator stopped answering (for longer than ``retry_for``) before the run completed."""


@dataclass(frozen=True)
class Completed:
    """A run this process saw complete: its coordinator, its last round and its final model's hash."""

    url: str
    round: int
    model_hash: str

    def error(self) -> RunCompleted:
        return run_completed(self.url, self.round, self.model_hash)


_completed: dict[str, Completed] = {}
_lock = threading.Lock()


def note_completed(url: str, round_: int, model_hash: str) -> None:
    with _lock:
        _completed[url.rstrip("/")] = Completed(url.rstrip("/"), round_, model_hash)


def completed_at(url: str) -> Completed | None:
    """The run at ``url`` that this process saw complete, if any."""
    with _lock:
        return _completed.get(url.rstrip("/"))


def run_completed(url: str, round_: int, model_hash: str | None) -> RunCompleted:
    return RunCompleted(
        f"the run at {url} has completed (after round {round_}, model hash {model_hash}); a run does not go on "
        "after it completes. To train on, start a new run: a new coordinator on a fresh run directory (`nodeox "
        "coordinator --run-dir NEW_DIR ...`, or `nodeox launch` with a fresh --run-dir), then fit with a new "
        "Trainer(strategy=NodeoxStrategy(...)) pointed at it; the first host to join provides its model, so "
        "training goes on from the weights this host holds.")


def run_not_completed(host: str, url: str, round_: int, steps: int, model_hash: str,
                      cause: Exception) -> RunNotCompleted:
    return RunNotCompleted(
        f"host {host}: the run did not complete: its coordinator at {url} stopped answering in round {round_}, "
        f"after {steps} training steps of this host (last model agreed: {model_hash or 'none'}): "
        f"{str(cause).rstrip('.')}. Start the coordinator again on the same run directory (it resumes the run) "
        "and this host's training again: it rejoins where the run stood. But if the run completed meanwhile "
        "(this host was paused or cut off past --final-wait; the other hosts say `the run completed`), it does "
        "not resume: the final model is in the coordinator's run directory, RUN_DIR/state/model-R.safetensors "
        "(R: the round its run.json names, saved as the coordinator exited).")
