"""NodeoxStrategy inside a real Trainer (this process is the host) against a real coordinator process."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import TwoOptimizers, data, socket_closed_port
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_nodeox import NodeoxStrategy, PhaseMonitor
from lightning_nodeox.core.hashing import model_hash
from lightning_nodeox.core.protocol import Unreachable
from lightning_nodeox.host.ledger_sampler import LedgerSampler
from lightning_nodeox.host.tensors import shared_tensors


def test_registered_as_nodeox() -> None:
    trainer = Trainer(strategy="nodeox", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, NodeoxStrategy)
    assert trainer.strategy.root_device == torch.device("cpu")


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ValueError, match="local_steps must be at least 1"):
        NodeoxStrategy(local_steps=0)
    with pytest.raises(ValueError, match="rounding"):
        NodeoxStrategy(rounding="up")


def test_missing_url_names_the_variable(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("NODEOX_COORDINATOR_URL", raising=False)
    trainer = Trainer(strategy=NodeoxStrategy(), max_steps=1, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="NODEOX_COORDINATOR_URL"):
        trainer.fit(TwoOptimizers(), data())


def test_unanswering_coordinator_is_a_clear_error(tmp_path) -> None:
    with socket_closed_port() as port:
        url = f"http://127.0.0.1:{port}"
        trainer = Trainer(strategy=NodeoxStrategy(coordinator_url=url, host_id="0", retry_for=1.0), max_steps=2,
                          logger=False, default_root_dir=tmp_path, enable_progress_bar=False)
        start = time.monotonic()
        with pytest.raises(Unreachable, match=url):
            trainer.fit(TwoOptimizers(), data())
        assert time.monotonic() - start < 15


@pytest.mark.slow
def test_two_optimizers_checkpoints_and_the_final_partial_round(coordinator, tmp_path) -> None:
    coord = coordinator(1)
    model = TwoOptimizers()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = Trainer(
        strategy=NodeoxStrategy(coordinator_url=coord.url, host_id="solo", local_steps=4),
        max_steps=2 * 5, callbacks=[PhaseMonitor(), checkpoints], default_root_dir=tmp_path,
        enable_progress_bar=False, log_every_n_steps=1)
    trainer.fit(model, data())
    # 5 batches (10 optimizer steps, two per batch) = rounds of 4, 4, and a final partial round of 2
    assert trainer.strategy.last_result.round == 2 and trainer.strategy.last_result.complete
    published = [e for e in coord.events() if e["phase"] == "sync_prepare"]
    assert [e["round"] for e in published] == [0, 1, 2]
    assert model_hash(shared_tensors(model)) == published[-1]["model_hash"] == trainer.strategy.model_hash
    assert "a.1.running_mean" in dict(shared_tensors(model))
    assert (tmp_path / "ckpt" / "last.ckpt").exists()
    # one device: a world of one, as Lightning's single-device strategy (no process group); the train loader's
    # sampler is the data ledger's, as DDP's would be a DistributedSampler (use_distributed_sampler=True)
    assert not torch.distributed.is_initialized() and trainer.strategy.launcher is None and trainer.world_size == 1
    assert type(trainer.train_dataloader.sampler) is LedgerSampler
    assert "loss_a" in trainer.logged_metrics
    assert coord.wait(30) == 0  # the coordinator exits once its only host has finished and left


def test_lightning_cli_takes_the_strategy_by_name(tmp_path) -> None:
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(TwoOptimizers, run=False, args=["--trainer.strategy=nodeox", "--trainer.logger=false",
                                                       f"--trainer.default_root_dir={tmp_path}"])
    assert isinstance(cli.trainer.strategy, NodeoxStrategy) and cli.trainer.strategy.settings.local_steps == 20
