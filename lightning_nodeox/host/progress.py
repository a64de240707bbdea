"""One line per round on each host: round, global step, loss (when one is logged), seconds waited for the
sync, and the model hash's prefix. It goes through Lightning's progress bar when one is shown (so the bar is
not broken), else to the ``lightning_nodeox`` logger."""

from __future__ import annotations

import logging
from collections import defaultdict

from ..core.phases import WAIT, PhaseRecord

log = logging.getLogger(__name__)


class RoundProgress:
    """A phase listener that adds up each round's waits, and writes the line when a round has been applied."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._wait: dict[int, float] = defaultdict(float)

    def __call__(self, record: PhaseRecord) -> None:
        if record.phase == WAIT:
            self._wait[record.round] += record.seconds

    def line(self, round_: int, step: int, model_hash: str, metrics: dict, complete: bool) -> str:
        wait = sum(self._wait.pop(r) for r in [r for r in self._wait if r <= round_])
        parts = [f"nodeox: host {self.host} round {round_}", f"step {step}"]
        loss = _loss_name(metrics)
        if loss is not None:
            parts.append(f"{loss} {float(metrics[loss]):.4g}")
        parts += [f"waited {wait:.2f}s", f"model {model_hash[:8]}"]
        return ", ".join(parts) + (" (the run is complete)" if complete else "")

    def show(self, trainer, line: str) -> None:
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled:
            bar.print(line)
        else:
            log.info(line)


def _loss_name(metrics: dict) -> str | None:
    """The training loss among the logged metrics: a name with "loss" in it, not a validation or test one,
    preferring the plain name to its ``_step``/``_epoch`` forms."""
    names = [k for k in metrics if "loss" in k.lower() and not k.lower().startswith(("val", "test"))]
    return min(names, key=lambda k: (k.endswith(("_step", "_epoch")), len(k)), default=None)
