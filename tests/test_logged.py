"""host/logged.py, the one reading of Lightning's private logging internals: it holds for the installed Lightning
(one of the versions it names), finds the value of a real ``self.log(..., sync_dist=True)`` and nothing else, and
is alone."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import torch
from helpers import data
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_nodeox.host.logged import LIGHTNING_VERSIONS, LoggedValue, epoch_values, logged_value

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_nodeox"
BATCHES, BATCH = 3, 16  # data(): 256 samples in batches of 16; three of them


def test_the_installed_lightning_is_one_the_reading_was_checked_with() -> None:
    version = tuple(int(p) for p in lightning.__version__.split(".")[:2])
    first, beyond = LIGHTNING_VERSIONS
    assert first <= version < beyond, (
        f"lightning {lightning.__version__}: host/logged.py reads Lightning's private _ResultMetric and was checked "
        f"with {first} up to {beyond}; check it against this version, then widen LIGHTNING_VERSIONS")


class Recording(SingleDeviceStrategy):
    """A one-device strategy whose reduce records what logged_value finds in its caller."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.found: list[tuple[LoggedValue | None, torch.Tensor]] = []
        self.pending: list[str] | None = None  # what epoch_values lists at the first epoch value's compute

    @property
    def is_distributed(self) -> bool:
        return True  # as NodeoxStrategy says, so that Lightning hands sync_dist values to reduce

    def reduce(self, tensor, group=None, reduce_op="mean"):
        value = logged_value(sys._getframe(1))
        self.found.append((value, tensor))
        if value is not None and value.epoch is not None and self.pending is None:
            self.pending = [v.name for v in epoch_values(self.lightning_module.trainer)]
        return tensor


class Logs(LightningModule):
    """Logs ``step_loss`` per step, ``epoch_loss`` as an epoch mean, and ``both`` on_step and on_epoch, all with
    sync_dist=True."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("step_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        self.log("epoch_loss", torch.tensor(float(batch_idx)), sync_dist=True, on_step=False, on_epoch=True)
        self.log("both", loss, sync_dist=True, on_step=True, on_epoch=True, reduce_fx="max")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), 0.01)


def test_a_real_sync_dist_log_is_found_with_its_full_name_and_an_epoch_means_sample_count(tmp_path) -> None:
    strategy = Recording()
    trainer = Trainer(strategy=strategy, max_epochs=1, limit_train_batches=BATCHES, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, default_root_dir=tmp_path)
    trainer.fit(Logs(), data())
    found = [(value.name, value.count, tensor) for value, tensor in strategy.found if value is not None]
    assert len(found) < len(strategy.found)  # Lightning's own reductions (batch sizes) are no logged value
    steps = [t for name, count, t in found if name == "step_loss"]
    assert len(steps) == BATCHES and all(count is None for name, count, _ in found if name == "step_loss")
    epoch = [(count, t) for name, count, t in found if name == "epoch_loss"]
    assert epoch, "the epoch mean's compute was not found"
    count, _ = epoch[0]
    assert count is not None and int(count) == BATCHES * BATCH  # the sample count the mean divides by
    sums = [t for c, t in epoch if t is not count]
    assert sums and float(sums[0]) == sum(range(BATCHES)) * BATCH  # batch_idx 0, 1, 2, each weighted by 16
    assert trainer.callback_metrics["epoch_loss"] == sum(range(BATCHES)) / BATCHES
    # a value logged on_step and on_epoch is found under Lightning's two names, its step values and its epoch value
    assert [n for n, _, _ in found if n.startswith("both")] == ["both_step"] * BATCHES + ["both_epoch"]
    # at the first epoch value's compute, the epoch values Lightning computes in that pass, in its order
    assert strategy.pending == ["epoch_loss", "both_epoch"]


def test_no_other_module_reads_lightnings_logging_internals() -> None:
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if "_ResultMetric" in p.read_text() or "logger_connector" in p.read_text())
    assert readers == ["host/logged.py"]
