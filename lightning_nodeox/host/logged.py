"""Which ``self.log(..., sync_dist=True)`` value a ``strategy.reduce`` call reduces, and which epoch values
Lightning is about to compute: the package's one reading of Lightning's private logging internals, kept here alone.

Lightning keeps each logged value in a ``_ResultMetric``, whose ``update`` (a step value) and ``compute`` (an
epoch value) call ``strategy.reduce`` directly (``meta.sync`` hands back a ``functools.partial``, so no frame of
Lightning's sits between them). The frame that called ``reduce`` is thus the metric's own; an epoch mean's
``compute`` reduces its sum and then its sample count, ``cumulated_batch_size``. A value is named as Lightning
names it in ``callback_metrics``: ``meta.forked_name`` (``loss_step`` and ``loss_epoch`` for a value logged
``on_step`` and ``on_epoch``, else ``loss``), with the ``/dataloader_idx_N`` suffix of an evaluation loader.

Read the same way in Lightning 2.4, 2.5 and 2.6 (``LIGHTNING_VERSIONS``); tests/test_logged.py checks the
installed version is among them and that a real ``self.log(..., sync_dist=True)`` is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import FrameType

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultCollection, _ResultMetric

LIGHTNING_VERSIONS = ((2, 4), (2, 7))  # from, up to (not including): the versions this module was checked with


@dataclass(frozen=True)
class EpochValue:
    """An epoch value Lightning has yet to compute: its full name, its accumulated value (for a mean: the sum of
    value times batch size), its sample count (a mean only) and its reduction (mean, sum, max, min)."""

    name: str
    value: torch.Tensor
    count: torch.Tensor | None
    reduction: str


@dataclass(frozen=True)
class LoggedValue:
    """A value being reduced: its full logged name, and for an epoch value (else a step value) what it is computed
    from; ``count``: an epoch mean's sample count (else None)."""

    name: str
    epoch: EpochValue | None

    @property
    def count(self) -> torch.Tensor | None:
        return self.epoch.count if self.epoch is not None else None


def logged_value(caller: FrameType) -> LoggedValue | None:
    """The ``self.log`` value whose update or compute is the frame ``caller`` that called ``strategy.reduce``;
    None when anything else called it (Lightning's own reductions, a torchmetrics object)."""
    metric = caller.f_locals.get("self")
    if not isinstance(metric, _ResultMetric):
        return None
    if caller.f_code.co_name == "compute":
        return LoggedValue(_name(metric.meta, on_step=False), _epoch_value(metric))
    return LoggedValue(_name(metric.meta, on_step=True), None)


def epoch_values(trainer) -> list[EpochValue]:
    """The epoch values logged with ``sync_dist=True`` that Lightning computes at this epoch's end and has not
    computed yet, in Lightning's order (every host, and every rank of a host, lists them alike)."""
    results: _ResultCollection | None = trainer._results
    if results is None:
        return []
    out = []
    for _, metric in results.valid_items():
        meta = metric.meta
        if not (metric.is_tensor and meta.on_epoch and meta.sync.should and not meta.sync.rank_zero_only
                and metric._computed is None):
            continue
        out.append(_epoch_value(metric))
    return out


def _epoch_value(metric: _ResultMetric) -> EpochValue:
    meta = metric.meta
    count = metric.cumulated_batch_size if meta.is_mean_reduction else None
    return EpochValue(_name(meta, on_step=False), metric.value, count, meta.reduce_fx.__name__)


def _name(meta: _Metadata, on_step: bool) -> str:
    name = meta.forked_name(on_step)
    if meta.add_dataloader_idx and meta.dataloader_idx is not None:
        name += _ResultCollection.DATALOADER_SUFFIX.format(meta.dataloader_idx)
    return name
