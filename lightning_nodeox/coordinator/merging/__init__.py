"""How rounds take the hosts' deltas: every live host's, in their own round (``--merge sync``, the default), or a
quorum's, with the late deltas merged into the round open when they arrive (``--merge async``).

Under ``async`` a delta computed from the model of round ``r`` that arrives while round ``R > r`` is open is
merged into round ``R`` with *staleness* ``s = R - r``, its weight in the round's mean set by a staleness rule
(``--staleness-rule``), one module each, registered here by name:

- ``age`` (:mod:`.age`): weight = samples / (1 + s): a delta counts less the older its base.
- ``samples`` (:mod:`.samples`): weight = samples, whatever its age (the rule of ``sync``, where s is always 0).

A delta staler than ``--max-staleness`` is refused (``STALE_BASE``: its host fetches the model). This module
imports nothing heavy, so that the ``nodeox`` command checks its flags without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

MODES = ("sync", "async")

_RULES: dict[str, type[StalenessRule] | str] = {
    "age": f"{__name__}.age:Age",
    "samples": f"{__name__}.samples:Samples",
}


def rule_names() -> tuple[str, ...]:
    """The names of the staleness rules known (the ``--staleness-rule`` choices)."""
    return tuple(_RULES)


@dataclass(frozen=True)
class MergeSettings:
    """How rounds close and take late deltas (``--merge`` and the flags of ``async``).

    Args:
        mode: ``"sync"`` (a round waits for every live host; a late delta is dropped) or ``"async"`` (a round
            closes on a quorum; a late delta is merged into the round open when it arrives).
        min_quorum: async: the fewest deltas (with samples) a round closes with, lowered to the hosts still in
            the run.
        grace: async: the longest a round waits, after its quorum, for a host whose delta of this very round is
            due (its past rounds say it arrives within the window); None: half the median time between two deltas
            of the run's hosts.
        max_staleness: async: the most rounds a delta's base may be behind the round it is merged into; a staler
            one is refused and its host fetches the model.
        staleness_rule: async: how a late delta is weighted (a registered rule's name).
    """

    mode: str = "sync"
    min_quorum: int | None = None
    grace: float | None = None
    max_staleness: int = 4
    staleness_rule: str = "age"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--merge {self.mode!r} is not known; use one of {MODES}")
        if self.staleness_rule not in _RULES:
            raise ValueError(f"--staleness-rule {self.staleness_rule!r} is not known; use one of {rule_names()}")
        if self.mode == "sync":
            return
        if self.min_quorum is None:
            raise ValueError("--merge async needs --min-quorum K: the fewest deltas a round closes with")
        if self.min_quorum < 1:
            raise ValueError(f"--min-quorum must be at least 1, got {self.min_quorum}")
        if self.grace is not None and not self.grace >= 0:
            raise ValueError(f"--grace must be seconds (>= 0), got {self.grace}")
        if self.max_staleness < 1:
            raise ValueError(f"--max-staleness must be at least 1 round, got {self.max_staleness}")

    @property
    def is_async(self) -> bool:
        return self.mode == "async"

    @property
    def kept_back(self) -> int:
        """Rounds before the latest whose syncs hosts behind may still need (0 under ``sync``)."""
        return self.max_staleness if self.is_async else 0


class StalenessRule:
    """How a delta merged ``staleness`` rounds after its base's round is weighted in the mean."""

    name: ClassVar[str]

    def weight(self, samples: int, staleness: int) -> float:
        """The delta's weight in its round's mean (``samples`` when it is not stale)."""
        raise NotImplementedError


def register(cls: type[StalenessRule]) -> type[StalenessRule]:
    """Make ``cls`` the rule named ``cls.name`` (a class decorator)."""
    _RULES[cls.name] = cls
    return cls


def staleness_rule(name: str) -> StalenessRule:
    """The rule registered as ``name`` (a rule of the package is imported here, the first time)."""
    kind = _RULES[name]
    if isinstance(kind, str):
        module, _, attr = kind.partition(":")
        kind = _RULES[name] = getattr(importlib.import_module(module), attr)
    return kind()
