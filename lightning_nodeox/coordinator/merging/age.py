"""``age``: a late delta's weight is its samples divided by one plus its staleness (a delta one round late counts
half, two rounds a third), as asynchronous SGD's polynomial staleness discounts do."""

from __future__ import annotations

from . import StalenessRule


class Age(StalenessRule):
    name = "age"

    def weight(self, samples: int, staleness: int) -> float:
        return samples / (1 + staleness)
