"""A test host for epoch metrics across hosts: a linear classifier on data of its own (each host's differs, and so
do its batch sizes), logging ``loss`` on_step and on_epoch, ``val_loss`` on_epoch and a torchmetrics ``Accuracy``,
all with sync_dist=True, under ReduceLROnPlateau on ``val_loss``.

It writes to --out what it saw itself (each batch's loss and size, correct predictions, the learning rate at each
epoch's start and after fit) and what Lightning gave it (``callback_metrics`` at each epoch's end, and after fit),
so the test can compute the cross-host values on its own. ``--extra-batches N``: host 1 has N more training batches
an epoch. ``--overlap``: rounds overlap training; ``--lag S`` with it: host 1's overlapped deltas land 2S seconds
late, and host 0 takes S seconds more for an epoch's last batch, so host 1 reaches the epoch's end first while
host 0's delta is in and its own is not yet (host 0 trains on: the epoch's values must wait for it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.host.client import HttpClient

CLASSES = 3


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, CLASSES)
        self.acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.seen: dict[str, list] = {"train": [], "val": [], "lr": []}

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.layer(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.acc(logits, y)
        self.log("loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("acc", self.acc, on_step=False, on_epoch=True, sync_dist=True)
        correct = int((logits.argmax(1) == y).sum())
        self.seen["train"].append([self.current_epoch, loss.item(), len(y), correct])
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.seen["val"].append([self.current_epoch, loss.item(), len(y)])

    def on_train_epoch_start(self):
        self.seen["lr"].append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0, threshold=0.1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss", "interval": "epoch"}}


class Record(Callback):
    """``callback_metrics`` at each training epoch's end (Lightning computes the epoch values on this read)."""

    def __init__(self) -> None:
        self.epochs: list[dict] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class SlowLastBatch(Callback):
    """Sleeps ``seconds`` before each epoch's last training batch."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == trainer.num_training_batches - 1:
            time.sleep(self.seconds)


def late_overlapped_deltas(seconds: float) -> None:
    """This host's overlapped deltas (sent while training goes on) land ``seconds`` late."""
    post = HttpClient.post_delta

    def late(self, round_, body, *, training=False):
        if training:
            time.sleep(seconds)
        return post(self, round_, body, training=training)

    HttpClient.post_delta = late


def loaders(host: int, extra: int) -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(100 + host)
    w = torch.tensor([[1.0, -1.0, 0.5], [0.5, 1.0, -1.0], [-1.0, 0.5, 1.0], [0.3, 0.3, 0.3]])

    def dataset(n: int) -> TensorDataset:
        x = torch.randn(n, 4, generator=g) + 0.7 * host  # the hosts' data differ
        y = (x @ w + 0.8 * torch.randn(n, CLASSES, generator=g)).argmax(1)
        return TensorDataset(x, y)

    batch = 8 if host == 0 else 4  # and so do their batch sizes: a mean across hosts is weighted by samples
    batches = 8 + (extra if host == 1 else 0)
    return (DataLoader(dataset(batches * batch), batch_size=batch),
            DataLoader(dataset(3 * batch + host), batch_size=batch))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--local-steps", type=int, default=3)
    p.add_argument("--extra-batches", type=int, default=0)
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--lag", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    host = int(os.environ["NODEOX_HOST_ID"])
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    model, record = Classifier(), Record()
    train, val = loaders(host, args.extra_batches)
    lag = [SlowLastBatch(args.lag)] if args.lag and host == 0 else []
    if args.lag and host == 1:
        late_overlapped_deltas(2 * args.lag)
    trainer = Trainer(strategy=NodeoxStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1,
                                              overlap=args.overlap),
                      max_epochs=args.epochs, use_distributed_sampler=False,  # uneven data: each host its own
                      callbacks=[record, *lag], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1)
    trainer.fit(model, train, val)
    model.seen["lr"].append(model.optimizers().param_groups[0]["lr"])  # after the last epoch's scheduler step
    (args.out / f"host{host}.json").write_text(json.dumps({
        "seen": model.seen, "epochs": record.epochs, "model_hash": trainer.strategy.model_hash,
        "after_fit": {k: float(v) for k, v in trainer.callback_metrics.items()}}))


if __name__ == "__main__":
    main()
