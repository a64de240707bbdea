"""``samples``: a late delta weighs its samples, however late, like a delta of its own round."""

from __future__ import annotations

from . import StalenessRule


class Samples(StalenessRule):
    name = "samples"

    def weight(self, samples: int, staleness: int) -> float:
        return float(samples)
