"""How values logged with ``self.log(..., sync_dist=True)`` are reduced across hosts, written once for the
coordinator (a round's values) and the hosts (an epoch's values): ``mean`` (and any reduction not listed) is the
mean weighted by each host's samples (a plain mean when none has any), ``sum``, ``max`` and ``min`` are what they
say."""

from __future__ import annotations

REDUCTIONS = {"sum": sum, "max": max, "min": min}


def reduce_values(pairs: list[tuple[float, float]], reduction: str) -> float:
    """The reduction of each host's ``(samples, value)``."""
    if reduction in REDUCTIONS:
        return float(REDUCTIONS[reduction](v for _, v in pairs))
    weight = sum(w for w, _ in pairs)
    if weight > 0:
        return sum(w * v for w, v in pairs) / weight
    return sum(v for _, v in pairs) / len(pairs)
