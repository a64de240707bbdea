"""A test host fine-tuning a frozen backbone: only the head trains until BackboneFinetuning unfreezes the backbone
at ``--unfreeze-at-epoch``; an epoch is one round. Started by `nodeox launch` in tests.

Writes OUT/host<id>.json (the model hash after every round, and after fit) and OUT/host<id>_final.safetensors
(the exchanged tensors after fit).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import BackboneFinetuning
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.host.tensors import shared_tensors

SAMPLES, BATCH = 64, 16  # four steps an epoch


class Finetune(LightningModule):
    """A backbone of two layers and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1)


class Record(Callback):
    """The model hash after each round."""

    def __init__(self, out: Path, host: str) -> None:
        self.out, self.host, self.rounds = out, host, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        result = trainer.strategy.last_result
        if result is not None:
            self.rounds.setdefault(result.round, result.model_hash)

    def on_fit_end(self, trainer, pl_module):
        result = trainer.strategy.last_result
        self.rounds.setdefault(result.round, result.model_hash)
        (self.out / f"host{self.host}.json").write_text(json.dumps(
            {"rounds": self.rounds, "final_hash": trainer.strategy.model_hash}))
        tensors = {n: t.detach().clone().contiguous() for n, t in shared_tensors(pl_module)}
        save_file(tensors, str(self.out / f"host{self.host}_final.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--unfreeze-at-epoch", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)  # every host starts from the same model
    model = Finetune()
    gen = torch.Generator().manual_seed(100 + int(host))
    x = torch.randn(SAMPLES, 16, generator=gen)
    data = TensorDataset(x, (x[:, :4].argmax(1)))
    loader = DataLoader(data, batch_size=BATCH, shuffle=True, generator=gen)
    freezing = BackboneFinetuning(unfreeze_backbone_at_epoch=args.unfreeze_at_epoch)
    trainer = Trainer(strategy=NodeoxStrategy(local_steps=SAMPLES // BATCH, cpu_threads=1, codec_threads=1),
                      max_epochs=args.epochs, use_distributed_sampler=False,  # each host its own data
                      callbacks=[freezing, Record(args.out, host)], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
