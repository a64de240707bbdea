"""Values logged with ``self.log(..., sync_dist=True)``, reduced across the hosts of a round.

Each delta carries its host's latest value of every such metric as ``[value, reduction]``; the round's sync
carries, for every name any host sent, the reduction across the hosts that sent it: ``mean`` (and any
reduction not listed) is the mean weighted by the samples each host trained in the round (a plain mean when
none trained), ``sum``, ``max`` and ``min`` are what they say.
"""

from __future__ import annotations

from collections import defaultdict

REDUCTIONS = {"sum": sum, "max": max, "min": min}


def reduce_metrics(contributions: list[tuple[int, dict[str, list]]]) -> dict[str, list]:
    """``{name: [value, reduction]}`` across hosts, from each host's ``(samples, metrics)``."""
    values: dict[str, list[tuple[int, float]]] = defaultdict(list)
    reductions: dict[str, str] = {}
    for samples, metrics in contributions:
        for name, (value, reduction) in metrics.items():
            values[name].append((samples, float(value)))
            reductions.setdefault(name, reduction)
    out = {}
    for name, pairs in values.items():
        reduction = reductions[name]
        if reduction in REDUCTIONS:
            out[name] = [REDUCTIONS[reduction](v for _, v in pairs), reduction]
            continue
        weight = sum(w for w, _ in pairs)
        mean = (sum(w * v for w, v in pairs) / weight) if weight > 0 else sum(v for _, v in pairs) / len(pairs)
        out[name] = [mean, reduction]
    return out
