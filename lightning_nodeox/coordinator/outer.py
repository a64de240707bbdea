"""The outer step: how the coordinator turns the round's mean delta into the sync delta, chunk by chunk.

Hosts send Δ_h = θ_h - θ_r; the coordinator forms the sample-weighted mean Δ̄ and hands it to the outer
optimizer one chunk at a time (in place, on the chunk the codec is about to quantize), so an optimizer's state
is one more tensor per parameter and nothing else is allocated. With the pseudo-gradient g = -Δ̄:

- ``average``: sync = Δ̄ (outer SGD with learning rate 1: plain averaging, FedAvg).
- ``nesterov`` (DiLoCo): m ← μ·m + Δ̄; sync = lr·(Δ̄ + μ·m) (SGD with Nesterov momentum on g, as
  ``torch.optim.SGD(nesterov=True)``; DiLoCo uses lr 0.7, μ 0.9).

The state lives in fp32 on the coordinator only; hosts apply the quantized sync, so it never breaks the
bit-identical model. torchft's DiLoCo instead feeds the pseudo-gradient to an ordinary torch optimizer through
``.grad``; that costs a gradient buffer and a copy of θ_r (2x the model in fp32) beyond the momentum, where this
chunked form costs the momentum alone (1x).

A step comes in two calls, so that a round whose result is refused (not finite) leaves the state as it was:
``step`` turns the mean into the sync without changing the state, ``commit`` updates the state once the round
is applied.
"""

from __future__ import annotations

import torch

from ..core.specs import TensorSpec
from .config import OuterSettings

class OuterOptimizer:
    """Plain averaging: the sync is the mean delta. Subclasses keep state in :attr:`state` (name -> tensor)."""

    def __init__(self, specs: tuple[TensorSpec, ...]) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        """Turn values ``[start, stop)`` of tensor ``i``'s mean delta (``mean``, in place) into the sync delta;
        the state is not changed."""

    def commit(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        """Update the state with values ``[start, stop)`` of tensor ``i``'s mean delta (the round was applied)."""


class Nesterov(OuterOptimizer):
    """SGD with Nesterov momentum on the pseudo-gradient; one fp32 momentum buffer per tensor."""

    def __init__(self, specs: tuple[TensorSpec, ...], lr: float, momentum: float) -> None:
        super().__init__(specs)
        self.lr, self.momentum = lr, momentum
        self.buffers = [torch.zeros(s.numel, dtype=torch.float32) for s in specs]
        self.state = {f"momentum/{s.name}": b for s, b in zip(specs, self.buffers)}

    def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        m = torch.mul(self.buffers[i][start:stop], self.momentum).add_(mean)  # what commit will store
        mean.add_(m, alpha=self.momentum).mul_(self.lr)

    def commit(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        self.buffers[i][start:stop].mul_(self.momentum).add_(mean)


def make_outer(settings: OuterSettings, specs: tuple[TensorSpec, ...]) -> OuterOptimizer:
    if settings.name == "nesterov":
        return Nesterov(specs, settings.lr, settings.momentum)
    return OuterOptimizer(specs)
