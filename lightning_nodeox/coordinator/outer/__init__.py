"""The outer step: how the coordinator turns the round's mean delta into the sync delta, chunk by chunk.

Hosts send Δ_h = θ_h - θ_r; the coordinator forms the sample-weighted mean Δ̄ and hands it to the outer
optimizer one chunk at a time (in place, on the chunk the codec is about to quantize), so an optimizer's state
is one more tensor per parameter and nothing else is allocated. The kinds, one module each:

- ``average`` (:mod:`.average`): sync = Δ̄ (outer SGD with learning rate 1: plain averaging, FedAvg).
- ``nesterov`` (:mod:`.nesterov`, DiLoCo): SGD with Nesterov momentum on the pseudo-gradient -Δ̄.

The state lives in fp32 on the coordinator only; hosts apply the quantized sync, so it never breaks the
bit-identical model. torchft's DiLoCo instead feeds the pseudo-gradient to an ordinary torch optimizer through
``.grad``; that costs a gradient buffer and a copy of θ_r (2x the model in fp32) beyond the momentum, where this
chunked form costs the momentum alone (1x).

A step comes in two calls, so that a round whose result is refused (not finite) leaves the state as it was:
``step`` turns the mean into the sync without changing the state, ``commit`` updates the state once the round
is applied. A kind says whether it has a step at all (:attr:`OuterOptimizer.has_step`); the coordinator calls
``step`` exactly when it does, and ``commit`` when it also has state.

A new kind is a class in a module of its own, registered under its name: :func:`register` for a class at hand,
or one line in ``_KINDS`` for a kind that ships with the package (named by module, imported on first use, so
that the ``nodeox`` command checks its flags without importing torch). This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

    from ...core.specs import TensorSpec

_KINDS: dict[str, type[OuterOptimizer] | str] = {
    "average": f"{__name__}.average:Average",
    "nesterov": f"{__name__}.nesterov:Nesterov",
}


def outer_names() -> tuple[str, ...]:
    """The names of the kinds known (the ``--outer-optimizer`` choices)."""
    return tuple(_KINDS)


@dataclass(frozen=True)
class OuterSettings:
    """The outer optimizer, as given on the command line and saved with the run's state (whole: a field added
    here is saved and resumed with the rest).

    Args:
        name: a registered kind: ``"average"`` or ``"nesterov"``.
        lr: outer learning rate (nesterov).
        momentum: outer momentum μ (nesterov).
    """

    name: str = "average"
    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.name not in _KINDS:
            raise ValueError(f"--outer-optimizer {self.name!r} is not known; use one of {outer_names()}")
        if not self.lr > 0:
            raise ValueError(f"--outer-lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.momentum}")


class OuterOptimizer:
    """One kind of outer optimizer. A kind sets :attr:`name` and :attr:`has_step`; one with a step overrides
    :meth:`step`, one with state keeps it in :attr:`state` (name -> fp32 tensor, saved with the run) and
    overrides :meth:`commit`."""

    name: ClassVar[str]
    has_step: ClassVar[bool] = True  # False: the sync is the mean delta itself, step is never called

    def __init__(self, settings: OuterSettings, specs: tuple[TensorSpec, ...]) -> None:
        self.settings = settings
        self.state: dict[str, torch.Tensor] = {}

    @property
    def has_state(self) -> bool:
        return bool(self.state)

    def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        """Turn values ``[start, stop)`` of tensor ``i``'s mean delta (``mean``, in place) into the sync delta;
        the state is not changed."""
        raise NotImplementedError(f"outer optimizer {self.name!r} says it has a step but defines none")

    def commit(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        """Update the state with values ``[start, stop)`` of tensor ``i``'s mean delta (the round was applied)."""


def register(cls: type[OuterOptimizer]) -> type[OuterOptimizer]:
    """Make ``cls`` the kind named ``cls.name`` (a class decorator). A kind whose ``has_step`` disagrees with
    whether it defines ``step`` is refused: it would silently never step, or fail at the first round."""
    if cls.has_step != (cls.step is not OuterOptimizer.step):
        raise TypeError(f"outer optimizer {cls.name!r}: has_step is {cls.has_step} but it "
                        f"{'defines no' if cls.has_step else 'defines a'} step(); make them agree")
    _KINDS[cls.name] = cls
    return cls


def outer_kind(name: str) -> type[OuterOptimizer]:
    """The class registered as ``name`` (a kind of the package is imported here, the first time)."""
    kind = _KINDS[name]
    if isinstance(kind, str):
        module, _, attr = kind.partition(":")
        kind = _KINDS[name] = register(getattr(importlib.import_module(module), attr))
    return kind


def make_outer(settings: OuterSettings, specs: tuple[TensorSpec, ...]) -> OuterOptimizer:
    """The outer optimizer ``settings`` name, for a model of ``specs``."""
    return outer_kind(settings.name)(settings, specs)
