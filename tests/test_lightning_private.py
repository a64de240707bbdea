"""host/lightning_private.py, the package's one reach past Lightning's public API: it holds for the installed
Lightning (one of the versions it names, every name it relies on still there), each workaround finds what it looks
for (the value of a real ``self.log(..., sync_dist=True)`` and nothing else; the script's line of a real
``fabric.all_reduce``; Fabric's refusal of a Trainer strategy), and it is alone: no other module reads Lightning's
logging internals or frames, or wraps Lightning's classes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import lightning
import torch
from helpers import data
from lightning.fabric import Fabric
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDevice
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.host.lightning_private import (
    LIGHTNING_VERSIONS, AllReduceCalls, LoggedValue, epoch_values, missing, value_being_reduced,
)

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_nodeox"
BATCHES, BATCH = 3, 16  # data(): 256 samples in batches of 16; three of them


def test_the_installed_lightning_is_one_the_reading_was_checked_with() -> None:
    version = tuple(int(p) for p in lightning.__version__.split(".")[:2])
    first, beyond = LIGHTNING_VERSIONS
    assert first <= version < beyond, (
        f"lightning {lightning.__version__}: host/lightning_private.py reads Lightning's private objects and frames "
        f"and was checked with {first} up to {beyond}; check each of its workarounds against this version (and look "
        "for a public way), then widen LIGHTNING_VERSIONS")


def test_every_name_the_workarounds_rely_on_is_still_there() -> None:
    lacking = missing()
    assert lacking == [], (f"lightning {lightning.__version__} lacks {lacking}, which host/lightning_private.py "
                           "relies on: find the public way or the new private name, and change that module alone")


def test_a_name_lightning_dropped_is_seen_missing() -> None:
    assert missing(((Trainer, "_results"), (Trainer, "_no_such_name"))) == ["Trainer._no_such_name"]


class Recording(SingleDeviceStrategy):
    """A one-device strategy whose reduce records what value_being_reduced finds."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.found: list[tuple[LoggedValue | None, torch.Tensor]] = []
        self.pending: list[str] | None = None  # what epoch_values lists at the first epoch value's compute

    @property
    def is_distributed(self) -> bool:
        return True  # as NodeoxStrategy says, so that Lightning hands sync_dist values to reduce

    def reduce(self, tensor, group=None, reduce_op="mean"):
        value = value_being_reduced()
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


class NamesItsValues(FabricSingleDevice):
    """A Fabric strategy whose all_reduce records the name AllReduceCalls gives each value."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.calls, self.names = AllReduceCalls(), []

    def all_reduce(self, tensor, group=None, reduce_op="mean"):
        self.names.append(self.calls.name())
        return tensor


def test_a_real_fabric_all_reduce_is_named_by_the_scripts_line_and_its_place_in_the_collection() -> None:
    strategy = NamesItsValues()
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.all_reduce(torch.tensor(1.0))
    fabric.all_reduce({"a": torch.tensor(1.0), "b": torch.tensor(2.0)})  # one call, two values
    line, here = sys._getframe().f_lineno, Path(__file__).name
    assert strategy.names == [f"all_reduce@{here}:{line - 2}", f"all_reduce@{here}:{line - 1}",
                              f"all_reduce@{here}:{line - 1}[1]"], "host/lightning_private.py lost the script's line"


def test_fabric_refuses_the_trainers_strategy_naming_the_fix() -> None:
    try:
        Fabric(strategy=NodeoxStrategy(local_steps=3), accelerator="cpu")
    except TypeError as e:
        assert "Fabric(strategy=NodeoxFabricStrategy(local_steps=3, ...))" in str(e)
    else:
        raise AssertionError("Fabric took NodeoxStrategy: host/lightning_private.py's refuse_in_fabric no longer "
                             "wraps Fabric's connector check")


def test_no_other_module_reads_lightnings_logging_internals() -> None:
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if "_ResultMetric" in p.read_text() or "logger_connector" in p.read_text())
    assert readers == ["host/lightning_private.py"]


REACHING_PAST = re.compile(r"sys\._getframe|inspect\.(currentframe|stack)|\.f_back\b|\.f_locals\b|_Connector\b")


def reaching_past(root: Path) -> list[str]:
    """The modules under ``root`` that read frames or name Lightning's connector."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if REACHING_PAST.search(p.read_text()))


def test_no_other_module_reads_frames_or_wraps_lightnings_connector() -> None:
    assert reaching_past(PACKAGE) == ["host/lightning_private.py"]


def test_a_module_reading_frames_is_seen(tmp_path: Path) -> None:
    for i, line in enumerate(("caller = sys._getframe(1)", "frame = inspect.currentframe().f_back",
                              "from lightning.fabric.connector import _Connector")):
        (tmp_path / f"probe{i}.py").write_text(line + "\n")
    (tmp_path / "clean.py").write_text("import sys\n")
    assert reaching_past(tmp_path) == ["probe0.py", "probe1.py", "probe2.py"]
