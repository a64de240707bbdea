"""``local_steps`` counts optimizer steps as ``trainer.global_step`` does, in manual and automatic optimization, and
a round closes only at a batch end (one host, through the in-process coordinator)."""

from __future__ import annotations

import torch
from helpers import TwoOptimizers, data
from lightning.pytorch import Callback, LightningModule, Trainer
from local_transport import LocalClient
from torch import nn

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.core.phases import TRAIN


class RoundSteps(Callback):
    """The global step at which each round's result came in: at a batch end, or at fit end for the final round."""

    def __init__(self) -> None:
        self.at: dict[int, int] = {}

    def _seen(self, trainer) -> None:
        result = trainer.strategy.last_result
        if result is not None:
            self.at.setdefault(result.round, trainer.global_step)

    def on_train_batch_end(self, trainer, *args) -> None:
        self._seen(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._seen(trainer)


class OneOptimizer(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def fit(local_coordinator, tmp_path, module: LightningModule, local_steps: int, **trainer_args) -> tuple[dict, list]:
    """One host's fit; the global step of each round, and the (steps, samples) of each round's training record."""
    c = local_coordinator(1)
    strategy = NodeoxStrategy(coordinator_url="http://unused.invalid", host_id="solo", local_steps=local_steps,
                              client=lambda conn: LocalClient(c, conn.host_id))
    steps = RoundSteps()
    trainer_args.setdefault("use_distributed_sampler", False)  # the host's own data: rounds close by steps alone
    trainer = Trainer(strategy=strategy, callbacks=[steps], default_root_dir=tmp_path, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, **trainer_args)
    trainer.fit(module, data())
    assert strategy.last_result.complete
    trained = [(r.extra["steps"], r.extra["samples"]) for r in strategy.phase_records if r.phase == TRAIN]
    return steps.at, trained


def test_two_optimizers_stepping_in_a_batch_are_two_steps(local_coordinator, tmp_path) -> None:
    at, trained = fit(local_coordinator, tmp_path, TwoOptimizers(), local_steps=10, max_steps=40)
    assert at == {0: 10, 1: 20, 2: 30, 3: 40}  # 20 batches of two opt.step() each: a round every 5 batches
    assert trained == [(10, 5 * 16)] * 4


def test_an_odd_local_steps_closes_at_the_batch_end_after_it(local_coordinator, tmp_path) -> None:
    at, trained = fit(local_coordinator, tmp_path, TwoOptimizers(), local_steps=3, max_steps=10)
    assert at == {0: 4, 1: 8, 2: 10}  # never between a batch's two steps: rounds of 4, 4 and the final 2
    assert trained == [(4, 32), (4, 32), (2, 16)]


def test_accumulated_batches_make_one_step(local_coordinator, tmp_path) -> None:
    at, trained = fit(local_coordinator, tmp_path, OneOptimizer(), local_steps=3, max_steps=7,
                      accumulate_grad_batches=2)
    assert at == {0: 3, 1: 6, 2: 7}  # optimizer steps 3 and 6 (batches 6 and 12), the final round at fit end
    assert trained == [(3, 6 * 16), (3, 6 * 16), (1, 2 * 16)]
