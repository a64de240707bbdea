"""Which ``self.log(..., sync_dist=True)`` value a ``strategy.reduce`` call reduces: the package's one reading of
Lightning's private logging internals, kept here alone.

Lightning keeps each logged value in a ``_ResultMetric``, whose ``update`` (a step value) and ``compute`` (an
epoch value) call ``strategy.reduce`` directly (``meta.sync`` hands back a ``functools.partial``, so no frame of
Lightning's sits between them). The frame that called ``reduce`` is thus the metric's own; an epoch mean's
``compute`` reduces its sum and then its sample count, ``cumulated_batch_size``.

Read the same way in Lightning 2.4, 2.5 and 2.6 (``LIGHTNING_VERSIONS``); tests/test_logged.py checks the
installed version is among them and that a real ``self.log(..., sync_dist=True)`` is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import FrameType

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

LIGHTNING_VERSIONS = ((2, 4), (2, 7))  # from, up to (not including): the versions this module was checked with


@dataclass(frozen=True)
class LoggedValue:
    """A value being reduced: its ``self.log`` name, and for an epoch mean its sample count (else None)."""

    name: str
    count: torch.Tensor | None


def logged_value(caller: FrameType) -> LoggedValue | None:
    """The ``self.log`` value whose update or compute is the frame ``caller`` that called ``strategy.reduce``;
    None when anything else called it (Lightning's own reductions, a torchmetrics object)."""
    metric = caller.f_locals.get("self")
    if not isinstance(metric, _ResultMetric):
        return None
    epoch_mean = caller.f_code.co_name == "compute" and metric.meta.is_mean_reduction
    return LoggedValue(metric.meta.name, metric.cumulated_batch_size if epoch_mean else None)
