"""``average``: the sync is the mean delta (outer SGD with learning rate 1: plain averaging, FedAvg)."""

from __future__ import annotations

from . import OuterOptimizer


class Average(OuterOptimizer):
    """Plain averaging: no step, no state."""

    name = "average"
    has_step = False
