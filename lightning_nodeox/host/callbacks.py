"""PhaseMonitor: logs each round's phases to the Trainer's loggers (TensorBoard by default)."""

from __future__ import annotations

import math
from collections import defaultdict

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from ..core import phases as P
from ..core.phases import PhaseRecord, metric_name


class PhaseMonitor(Callback):
    """Logs ``nodeox/<phase>_s`` for every host phase of every round, ``nodeox/sync_s`` (download + apply +
    verify), ``nodeox/upload_bytes`` and ``nodeox/q4_rel_error``, at the global step where the round ended
    (one point per step: rounds that end at the same step add up; a final round that trained nothing after a
    step already logged is left to the run directory's ``events.jsonl`` and ``tb/``).

    Needs :class:`~lightning_nodeox.NodeoxStrategy`; with any other strategy it warns once and logs nothing.
    """

    def __init__(self) -> None:
        self._logged_step = -1

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not hasattr(trainer.strategy, "phase_records"):
            rank_zero_warn(f"PhaseMonitor logs the phases of NodeoxStrategy, but this Trainer uses "
                           f"{type(trainer.strategy).__name__}: it logs nothing. Use Trainer(strategy=NodeoxStrategy()).")

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._log(trainer)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer)  # the final round closes after the last batch

    def _log(self, trainer: Trainer) -> None:
        records = getattr(trainer.strategy, "phase_records", None)
        if not records:
            return
        taken = []
        while records:
            taken.append(records.popleft())
        if trainer.global_step == self._logged_step:
            return
        self._logged_step = trainer.global_step
        metrics = round_metrics(taken)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def round_metrics(records: list[PhaseRecord]) -> dict[str, float]:
    """One round's host metrics: seconds per phase, sync as the sum of its parts, bytes and q4 error."""
    metrics: dict[str, float] = defaultdict(float)
    for r in records:
        metrics[metric_name(r.phase)] += r.seconds
        if r.phase == P.UPLOAD and r.bytes is not None:
            metrics[metric_name(P.UPLOAD, "bytes")] += r.bytes
        error = r.extra.get("q4_rel_error")
        if error is not None and math.isfinite(error):
            metrics["nodeox/q4_rel_error"] = float(error)
    parts = [metric_name(p) for p in P.SYNC_PARTS]
    if any(p in metrics for p in parts):
        metrics[metric_name("sync")] = sum(metrics.get(p, 0.0) for p in parts)
    return dict(metrics)
