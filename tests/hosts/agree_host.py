"""A test host for agreement at the end of a run: a tiny BatchNorm MLP on synthetic data, optionally with
Lightning's StochasticWeightAveraging or EMAWeightAveraging (which write each host's own average into the model
in on_train_end).

It writes OUT/host<id>_trained.safetensors and OUT/host<id>_train_end.safetensors (the exchanged tensors in a
callback's ``on_train_end`` before and after the weight-averaging callbacks'), OUT/host<id>_fit_end.safetensors (the exchanged tensors and ``strategy.model_hash`` in
a callback's ``on_fit_end``) and, after ``fit`` returns, OUT/host<id>_final.safetensors
and OUT/host<id>_after_fit.json (``strategy.model_hash``, ``global_step``). Started by `nodeox launch` in tests.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxStrategy
from lightning_nodeox.host.tensors import shared_tensors

BATCHES_PER_EPOCH = 7  # epochs end inside rounds (local_steps 5): SWA's per-epoch average differs between hosts


class Net(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def save(path: Path, module: LightningModule, model_hash: str | None) -> None:
    tensors = {n: t.detach().cpu().clone().contiguous() for n, t in shared_tensors(module)}
    save_file(tensors, str(path), metadata={"model_hash": model_hash or "", "order": json.dumps(list(tensors))})


class AtTrainEnd(Callback):
    """Saves the tensors in on_train_end (after the averaging callbacks: what this host's final round sends)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        save(self.path, pl_module, None)


class AtFitEnd(Callback):
    """Saves the tensors and the strategy's hash in on_fit_end (last in the list: after the averaging ones)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_end(self, trainer, pl_module):
        save(self.path, pl_module, trainer.strategy.model_hash)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-steps", default="20", help="optimizer steps, or one number per host id: 20,13")
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--callback", default="none", choices=("none", "swa", "ema"))
    p.add_argument("--csv-logs", type=Path, help="log to CSVLogger(CSV_LOGS), every step (default: no logger)")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(100 + int(host))
    gen = torch.Generator().manual_seed(int(host))
    x = torch.randn(BATCHES_PER_EPOCH * 16, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen)
    per_host = [int(s) for s in args.max_steps.split(",")]
    max_steps = per_host[int(host)] if len(per_host) > 1 else per_host[0]
    callbacks: list[Callback] = [AtTrainEnd(args.out / f"host{host}_trained.safetensors")]  # before the averaging
    if args.callback == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1))
    elif args.callback == "ema":
        callbacks.append(EMAWeightAveraging(decay=0.9))
    callbacks.append(AtTrainEnd(args.out / f"host{host}_train_end.safetensors"))
    callbacks.append(AtFitEnd(args.out / f"host{host}_fit_end.safetensors"))
    strategy = NodeoxStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1)
    logger = CSVLogger(args.csv_logs) if args.csv_logs else False
    trainer = Trainer(strategy=strategy, max_steps=max_steps, use_distributed_sampler=False,  # each its own data
                      callbacks=callbacks, logger=logger, log_every_n_steps=1,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    trainer.fit(model, loader)
    save(args.out / f"host{host}_final.safetensors", model, strategy.model_hash)
    (args.out / f"host{host}_after_fit.json").write_text(json.dumps(
        {"global_step": trainer.global_step, "model_hash": strategy.model_hash,
         "last_round": strategy.last_result.round if strategy.last_result else -1}))


if __name__ == "__main__":
    main()
