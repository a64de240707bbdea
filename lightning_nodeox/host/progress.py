"""One line per round on each host: round, global step, loss (when one is logged), seconds waited for the
sync, and the model hash's prefix. It goes through Lightning's progress bar while one is shown (so the bar is
not broken), else to the ``lightning_nodeox`` logger.

Rounds shorter than ``EVERY_S`` seconds are folded: a line is shown at most every ``EVERY_S`` seconds, and the
next one covers the rounds since the last (``rounds 12-40``, the wait their total); the first round and the one
that completes the run are always shown.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable

from ..core.phases import WAIT, PhaseRecord

log = logging.getLogger(__name__)

EVERY_S = 5.0  # at most one progress line per host this often


class RoundProgress:
    """A phase listener that adds up each round's waits, and writes the line when a round has been applied."""

    def __init__(self, host: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.clock = clock
        self._wait: dict[int, float] = defaultdict(float)
        self._shown_at: float | None = None
        self._folded: int | None = None  # the first round not shown yet
        self._folded_wait = 0.0

    def __call__(self, record: PhaseRecord) -> None:
        if record.phase == WAIT:
            self._wait[record.round] += record.seconds

    def line(self, round_: int, step: int, model_hash: str, metrics: dict, complete: bool) -> str | None:
        """The line to show now that ``round_`` was applied, or None when it is folded into a later line."""
        self._folded_wait += sum(self._wait.pop(r) for r in [r for r in self._wait if r <= round_])
        first = round_ if self._folded is None else self._folded
        now = self.clock()
        if not complete and self._shown_at is not None and now - self._shown_at < EVERY_S:
            self._folded = first
            return None
        self._shown_at, self._folded, wait, self._folded_wait = now, None, self._folded_wait, 0.0
        rounds = f"round {round_}" if first == round_ else f"rounds {first}-{round_}"
        parts = [f"nodeox: host {self.host} {rounds}", f"step {step}"]
        loss = _loss_name(metrics)
        if loss is not None:
            parts.append(f"{loss} {float(metrics[loss]):.4g}")
        parts += [f"waited {wait:.2f}s", f"model {model_hash[:8]}"]
        return ", ".join(parts) + (" (the run is complete)" if complete else "")

    def show(self, trainer, line: str | None) -> None:
        if line is None:
            return
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled and not _closed(bar):
            bar.print(line)
        else:
            log.info(line)


def _closed(bar) -> bool:
    """Whether a tqdm progress bar has closed its training bar (at train end, where a final round may close): its
    ``print`` would then drop the line."""
    try:
        return bool(bar.train_progress_bar.disable)
    except (AttributeError, TypeError):  # not a TQDMProgressBar, or its bar not made yet
        return False


def _loss_name(metrics: dict) -> str | None:
    """The training loss among the logged metrics: a name with "loss" in it, not a validation or test one,
    preferring the plain name to its ``_step``/``_epoch`` forms."""
    names = [k for k in metrics if "loss" in k.lower() and not k.lower().startswith(("val", "test"))]
    return min(names, key=lambda k: (k.endswith(("_step", "_epoch")), len(k)), default=None)
