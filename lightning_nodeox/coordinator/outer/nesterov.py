"""``nesterov`` (DiLoCo): m ← μ·m + Δ̄; sync = lr·(Δ̄ + μ·m), SGD with Nesterov momentum on the pseudo-gradient
g = -Δ̄ (as ``torch.optim.SGD(nesterov=True)``; DiLoCo uses lr 0.7, μ 0.9). One fp32 momentum buffer per
tensor."""

from __future__ import annotations

import torch

from ...core.specs import TensorSpec
from . import OuterOptimizer, OuterSettings


class Nesterov(OuterOptimizer):
    """SGD with Nesterov momentum on the pseudo-gradient; the momentum is its state."""

    name = "nesterov"

    def __init__(self, settings: OuterSettings, specs: tuple[TensorSpec, ...]) -> None:
        super().__init__(settings, specs)
        self.lr, self.momentum = settings.lr, settings.momentum
        self.buffers = [torch.zeros(s.coded, dtype=torch.float32) for s in specs]
        self.state = {f"momentum/{s.name}": b for s, b in zip(specs, self.buffers) if not s.raw}  # raw: no step

    def step(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        m = torch.mul(self.buffers[i][start:stop], self.momentum).add_(mean)  # what commit will store
        mean.add_(m, alpha=self.momentum).mul_(self.lr)

    def commit(self, i: int, mean: torch.Tensor, start: int, stop: int) -> None:
        self.buffers[i][start:stop].mul_(self.momentum).add_(mean)
