"""Values logged with ``self.log(..., sync_dist=True)``, reduced across the hosts of a round.

Each delta carries its host's latest value of every such metric as ``[value, reduction]``; the round's sync
carries, for every name any host sent, the reduction across the hosts that sent it
(:func:`~lightning_nodeox.core.reduction.reduce_values`, weighted by the samples each host trained in the round).
"""

from __future__ import annotations

from collections import defaultdict

from ..core.reduction import reduce_values


def reduce_metrics(contributions: list[tuple[int, dict[str, list]]]) -> dict[str, list]:
    """``{name: [value, reduction]}`` across hosts, from each host's ``(samples, metrics)``."""
    values: dict[str, list[tuple[int, float]]] = defaultdict(list)
    reductions: dict[str, str] = {}
    for samples, metrics in contributions:
        for name, (value, reduction) in metrics.items():
            values[name].append((samples, float(value)))
            reductions.setdefault(name, reduction)
    return {name: [reduce_values(pairs, reductions[name]), reductions[name]] for name, pairs in values.items()}
