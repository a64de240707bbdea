"""The chaos soak's host: the test hosts' small BatchNorm MLP (tests/hosts/digits_host.py) on scikit-learn's digits,
trained under NodeoxStrategy at a fixed pace, that keeps its own ledger of what it trained.

Every host trains on the same training split (1437 images; ``--seed`` shuffles it per host and draws the model the
run's first host provides) and, at fit's end, is scored on the held-out split (360 images). Run as a process by
benchmarks/soak_run.py with ``NODEOX_HOST_ID`` and ``NODEOX_COORDINATOR_URL`` set. It writes under ``--out``:

- ``host<id>.pid``: its own process id (the process to stop or kill, also when started through a forwarder);
- ``host<id>.ledger.jsonl``: one line per start (``{"started": t, "pid": ...}``), per phase record of the strategy
  (``{"round", "phase", "start", "end"}``) and per round taken (``{"taken", "contributed", "model_hash", "at"}``),
  and per batch (``{"batch_end": t}``), flushed as it goes, so that a host killed -9 leaves what it trained up to
  its last batch (its round's ``train`` record comes only with the round's sync);
- ``host<id>.final.json``: its final model's hash, last round and held-out accuracy.

Training ends gracefully (its final round follows, which completes the run) once ``--stop-file`` exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxStrategy

HELD_OUT = 360


def digits_split(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Digits as (training, held-out) datasets: a fixed permutation (``seed``), the last HELD_OUT images held out."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = torch.tensor(x / 16.0, dtype=torch.float32)[order], torch.tensor(y)[order]
    return TensorDataset(x[:-HELD_OUT], y[:-HELD_OUT]), TensorDataset(x[-HELD_OUT:], y[-HELD_OUT:])


class DigitsMLP(LightningModule):
    """tests/hosts/digits_host.py's model: Linear 64-64, BatchNorm, ReLU, Linear 64-10; SGD lr 0.05, momentum 0.9."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    @torch.no_grad()
    def accuracy(self, data: TensorDataset) -> float:
        """The share of ``data`` this model classifies right (evaluation mode: BatchNorm's running statistics)."""
        was = self.training
        self.eval()
        x, y = data.tensors
        right = int((self.net(x).argmax(1) == y).sum())
        self.train(was)
        return right / len(y)


class Ledger(Callback):
    """Appends the strategy's phase records, each round taken and each batch's end to ``path``, line by line."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
        self.file.write(json.dumps({"started": time.time(), "pid": os.getpid()}) + "\n")
        self.taken = -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._drain(trainer)
        self.file.write(json.dumps({"batch_end": time.time()}) + "\n")  # training since the last round taken

    def on_fit_end(self, trainer, pl_module):
        self._drain(trainer)

    def _drain(self, trainer) -> None:
        records = trainer.strategy.phase_records
        while records:
            r = records.popleft()
            self.file.write(json.dumps({"round": r.round, "phase": r.phase, "start": r.start, "end": r.end}) + "\n")
        result = trainer.strategy.last_result
        if result is not None and result.round != self.taken:
            self.taken = result.round
            self.file.write(json.dumps({"taken": result.round, "contributed": result.contributed,
                                        "model_hash": result.model_hash, "at": time.time()}) + "\n")


class Pace(Callback):
    """Sleeps at every training step: a host of known speed (the soak's rounds last long enough to hit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(self.seconds)


class StopWhen(Callback):
    """Ends training (gracefully: the final round follows) once a file exists."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.path.exists():
            trainer.should_stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stop-file", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0, help="the model's initial weights and each host's data order")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.03, help="sleep this long at every step (pacing)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--retry-for", type=float, default=600.0, help="seconds the host rides out an unreachable run")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host{host}.pid").write_text(str(os.getpid()))
    index = int(host)
    torch.manual_seed(1000 * args.seed + index)
    train, held_out = digits_split()
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(1000 * args.seed + index))
    model = DigitsMLP()
    strategy = NodeoxStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1, retry_for=args.retry_for)
    trainer = Trainer(strategy=strategy, max_epochs=-1, max_steps=-1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False,  # each host its own shuffle of all of it, as before the ledger
                      callbacks=[Ledger(args.out / f"host{host}.ledger.jsonl"), Pace(args.step_seconds),
                                 StopWhen(args.stop_file)])
    trainer.fit(model, loader)
    (args.out / f"host{host}.final.json").write_text(json.dumps(
        {"model_hash": strategy.model_hash, "last_round": strategy.last_result.round if strategy.last_result else -1,
         "accuracy": model.accuracy(held_out)}))


if __name__ == "__main__":
    main()
