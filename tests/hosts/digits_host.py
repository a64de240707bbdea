"""A test host: a small BatchNorm MLP on scikit-learn's digits, trained under NodeoxStrategy.

After every round (and at the end) it writes its exchanged tensors and model hash to --out, so tests can
check that hosts are bit-identical and agree with the coordinator; after fit, its callback metrics and step.
Started by `nodeox launch` in tests. With ``--devices K`` (or one K per host id, ``--devices 2,1``) the host runs
DDP over K CPU ranks (on each of ``--num-nodes`` machines: torchrun --nnodes); the files of a rank other than 0
are named ``host<id>.rank<k>_*``. With ``--ledger`` the host lets the coordinator's data ledger share out the data
(Lightning's default ``use_distributed_sampler=True``; on several devices its ranks read the host's leases in rows);
else each host trains on its own shuffle of all of it (on several devices, split among its ranks by a
``DistributedSampler`` of its own, as Lightning's would). ``--log-indices`` writes the sample indices each training
step consumed, with its epoch, to ``host<id>_indices.json``; with ``--ledger`` also, as each step trains, a line of
its round, ledger epoch and indices to ``host<id>_steps.jsonl`` (kept by a host killed). ``--join-file`` holds the
host back until the file exists (a host joining mid-run, started ahead). ``--log-indices`` also writes each
step's ``[epoch, round, samples]`` to ``host<id>_steps.json`` (its round: the one after the last whose result the
host took, so without overlap the round it trained in). ``--step-seconds`` paces every step (one value, or one per
host id: a slow host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from safetensors.torch import save_file
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_nodeox import LedgerShards, NodeoxStrategy, PhaseMonitor
from lightning_nodeox.host.tensors import shared_tensors


class DigitsNet(LightningModule):
    def __init__(self, lr: float = 0.05, host: int = 0, stop_host: int = -1, fail_at_step: int = -1,
                 epoch_value: bool = False) -> None:
        super().__init__()
        self.epoch_value = epoch_value
        self.acc = MulticlassAccuracy(num_classes=10, average="micro") if epoch_value else None
        self.counts: list[list[int]] = []  # [correct, samples] of each batch
        self.net = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
        self.lr = lr
        self.host = host
        self.stop_host = stop_host
        self.fail_at_step = fail_at_step
        self.indices: list[list[int]] = []  # [epoch, index] of each sample trained (a dataset that gives indices)
        self.step_rounds: list[list[int]] = []  # [epoch, round, samples] of each step (with indices; overlap off)
        self.steps_log: Path | None = None  # each step's indices appended here as it trains (a host killed keeps it)

    def _log_step(self, indices: list[int]) -> None:
        """One line per training step: the round its training goes into (this host's open round: its delta of that
        round carries it), the ledger's epoch its samples are of, and their indices."""
        strategy = self.trainer.strategy
        if strategy._session.link is None:  # a rank other than 0 of its host: its indices are in its _indices.json
            return
        loader = self.trainer.train_dataloader
        sampler = loader.dataset.data.sampler if isinstance(loader.dataset, LedgerShards) else loader.sampler
        line = {"round": strategy._session.link.round.round, "epoch": sampler.epoch, "indices": indices}
        with open(self.steps_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at_step:
            raise RuntimeError(f"injected failure in training_step at step {self.global_step}")
        x, y = batch[:2]
        if len(batch) > 2:
            self.indices += [[self.current_epoch, int(i)] for i in batch[2]]
            if self.steps_log is not None:
                self._log_step([int(i) for i in batch[2]])
            result = self.trainer.strategy.last_result  # the round this step trains in: the one after the last taken
            self.step_rounds.append([self.current_epoch, -1 if result is None else result.round + 1, len(batch[2])])
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)  # across the host's ranks, then the hosts
        if self.epoch_value:  # epoch values: exchanged at the epoch's end (here: fit's end), by rank 0 of a host
            self.log("rank_epoch", float(self.global_rank), on_step=False, on_epoch=True, sync_dist=True)
            self.acc(logits, y)  # a torchmetrics state: gathered across the host's ranks, then across hosts
            self.log("acc", self.acc, on_step=False, on_epoch=True, sync_dist=True)
            self.counts.append([int((logits.argmax(1) == y).sum()), len(y)])
        if self.stop_host >= 0:
            self.log("stop_signal", 0.0 if self.host == self.stop_host else 1.0)  # this host's own, not shared
            value = torch.tensor(10.0 * (self.host + 1))  # differs between hosts: 10, 20, ...
            self.log("shared_step", value, sync_dist=True)
            self.log("shared_epoch", value, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class OwnData(LightningDataModule):
    """A host of several devices without the data ledger: its ranks split the host's own data with a
    DistributedSampler given to the loader (the one Lightning would make), which the ledger leaves alone."""

    def __init__(self, data: TensorDataset, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        sampler = DistributedSampler(self.data, trainer.world_size, trainer.global_rank, shuffle=True, seed=0)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler, drop_last=True)


class DumpRounds(Callback):
    """Writes the shared tensors after each completed round, and the losses seen."""

    def __init__(self, out: Path, host: str) -> None:
        self.out, self.host, self.seen, self.losses, self.times, self.shared = out, host, -1, [], [], []

    def _prefix(self, trainer) -> str:
        return f"host{self.host}" + (f".rank{trainer.global_rank}" if trainer.global_rank else "")

    def _dump(self, trainer, name: str) -> None:
        result = trainer.strategy.last_result
        tensors = {n: t.detach().cpu().clone().contiguous() for n, t in shared_tensors(trainer.lightning_module)}
        save_file(tensors, str(self.out / f"{self._prefix(trainer)}_{name}.safetensors"),
                  metadata={"model_hash": trainer.strategy.model_hash or "", "order": json.dumps(list(tensors)),
                            "round": str(result.round if result else -1)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not outputs:  # a step skipped (a batch read under a data lease found void since)
            return
        self.losses.append(float(outputs["loss"]))
        self.times.append(time.time())
        self.shared.append(float(trainer.callback_metrics.get("shared_step", math.nan)))
        result = trainer.strategy.last_result
        if result is not None and result.round != self.seen:
            self.seen = result.round
            self._dump(trainer, f"round{result.round}")

    def on_exception(self, trainer, pl_module, exception):
        (self.out / f"{self._prefix(trainer)}_interrupted.json").write_text(json.dumps(
            {"at": time.time(), "exception": type(exception).__name__}))

    def on_fit_end(self, trainer, pl_module):
        self._dump(trainer, "final")
        (self.out / f"{self._prefix(trainer)}_losses.json").write_text(json.dumps(self.losses))
        (self.out / f"{self._prefix(trainer)}_loss_times.json").write_text(json.dumps(self.times))
        (self.out / f"{self._prefix(trainer)}_shared.json").write_text(json.dumps(self.shared))
        (self.out / f"{self._prefix(trainer)}_metrics.json").write_text(
            json.dumps({k: float(v) for k, v in trainer.callback_metrics.items()}))


class Stall(Callback):
    """Sleeps once, at one training step (a host that is slow for a while)."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


class Pace(Callback):
    """Sleeps at every training step (a host of known speed, or a run long enough to be interrupted)."""

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
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--skip-sync-round", type=int, default=-1, help="host 1 skips applying this round's sync")
    p.add_argument("--stall-round", type=int, default=-1, help="--stall-host stalls in this round (--stall-seconds)")
    p.add_argument("--stall-seconds", type=float, default=0.0)
    p.add_argument("--fail-round", type=int, default=-1, help="host 1's training_step raises mid-way through this round")
    p.add_argument("--step-seconds", default="0", help="sleep this long at every step (pacing), or one value per "
                   "host id: 0.02,0.06")
    p.add_argument("--stop-file", type=Path, help="end training once this file exists")
    p.add_argument("--stall-host", default="1")
    p.add_argument("--stop-host", type=int, default=-1,
                   help="EarlyStopping on every host, triggered on this host alone at its first epoch end; "
                        "also logs values with sync_dist=True")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save OUT/host<id>.ckpt every N steps")
    p.add_argument("--resume", type=Path, help="resume fit from this checkpoint")
    p.add_argument("--overlap", default="off", choices=("off", "eager", "delayed"))
    p.add_argument("--round-seconds", type=float)
    p.add_argument("--progress-bar", action="store_true", help="show Lightning's progress bar")
    p.add_argument("--epoch-value", action="store_true",
                   help="also log an epoch value and a torchmetrics Accuracy with sync_dist=True")
    p.add_argument("--devices", default="1", help="devices (CPU ranks) of the host, or one number per host id: 2,1")
    p.add_argument("--num-nodes", default="1", help="machines of the host (torchrun --nnodes), or one per host id")
    p.add_argument("--error-feedback", default="on", help="on or off, or one per host id: on,off")
    p.add_argument("--fragments", type=int, default=1, help="NodeoxStrategy(fragments=F)")
    p.add_argument("--ledger", action="store_true", help="the coordinator shares out the data (one device: the "
                   "loader's sampler is the ledger's; the loader keeps its last partial batch)")
    p.add_argument("--log-indices", action="store_true", help="write the indices each step trained to --out")
    p.add_argument("--max-epochs", type=int)
    p.add_argument("--shards", type=int, default=0, help="the data is this many shards (LedgerShards of in-memory "
                   "lists of contiguous samples; with --ledger the ledger leases shards)")
    p.add_argument("--join-file", type=Path, help="join the run (start fit) only once this file exists")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host{host}.pid").write_text(str(os.getpid()))
    torch.manual_seed(1234 + int(host))  # hosts start different: the run's first host provides the model
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y),
                         *([torch.arange(len(y))] if args.log_indices else []))
    gen = torch.Generator().manual_seed(int(host))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, generator=gen, drop_last=not args.ledger)
    if args.shards:
        size = -(-len(data) // args.shards)
        shards = {str(k): [data[i] for i in range(k * size, min((k + 1) * size, len(data)))] for k in range(args.shards)}
        loader = DataLoader(LedgerShards(list(shards), shards.__getitem__), batch_size=args.batch_size)
    fail = args.fail_round * args.local_steps + args.local_steps // 2 if args.fail_round >= 0 and host == "1" else -1
    model = DigitsNet(host=int(host), stop_host=args.stop_host, fail_at_step=fail, epoch_value=args.epoch_value)
    if args.skip_sync_round >= 0 and host == "1":
        from lightning_nodeox.host.tensors import HostTensors

        original = HostTensors.apply_piece

        def skip_once(self, applying, k):
            if applying.sync.meta.round != args.skip_sync_round:  # else as if this round's sync never reached it
                original(self, applying, k)

        HostTensors.apply_piece = skip_once
    callbacks = [PhaseMonitor(), DumpRounds(args.out, host)]
    if args.stall_round >= 0 and host == args.stall_host:
        callbacks.append(Stall(args.stall_round * args.local_steps + 1, args.stall_seconds))
    paces = [float(v) for v in args.step_seconds.split(",")]
    pace = paces[int(host)] if len(paces) > 1 else paces[0]
    if pace > 0:
        callbacks.append(Pace(pace))
    if args.stop_file is not None:
        callbacks.append(StopWhen(args.stop_file))
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=args.out, filename=f"host{host}", every_n_train_steps=args.checkpoint_every,
                                         save_top_k=-1, enable_version_counter=False))
    if args.stop_host >= 0:
        callbacks.append(EarlyStopping("stop_signal", mode="min", stopping_threshold=0.5, check_on_train_epoch_end=True))
    feedback = args.error_feedback.split(",")
    strategy = NodeoxStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1,
                              overlap=False if args.overlap == "off" else args.overlap, round_seconds=args.round_seconds,
                              error_feedback=feedback[int(host) if len(feedback) > 1 else 0] == "on",
                              fragments=args.fragments)
    per_host = [int(k) for k in args.devices.split(",")]
    devices = per_host[int(host)] if len(per_host) > 1 else per_host[0]
    machines = [int(m) for m in args.num_nodes.split(",")]
    num_nodes = machines[int(host)] if len(machines) > 1 else machines[0]
    trainer = Trainer(strategy=strategy, devices=devices, num_nodes=num_nodes,
                      accelerator="cpu" if devices * num_nodes > 1 else "auto",
                      max_steps=args.max_steps, max_epochs=args.max_epochs,
                      use_distributed_sampler=args.ledger or devices * num_nodes > 1, logger=TensorBoardLogger(args.out / f"tb_host{host}"),
                      callbacks=callbacks, enable_checkpointing=bool(args.checkpoint_every),
                      enable_progress_bar=args.progress_bar, enable_model_summary=False, log_every_n_steps=1)
    if args.log_indices and args.ledger:
        model.steps_log = args.out / f"host{host}_steps.jsonl"
    while args.join_file is not None and not args.join_file.exists():
        time.sleep(0.05)
    if devices * num_nodes > 1 and not args.ledger:
        trainer.fit(model, datamodule=OwnData(data, args.batch_size), ckpt_path=args.resume)
    else:
        trainer.fit(model, loader, ckpt_path=args.resume)
    after = {k: float(v) for k, v in trainer.callback_metrics.items()}
    prefix = f"host{host}" + (f".rank{trainer.global_rank}" if trainer.global_rank else "")
    (args.out / f"{prefix}_counts.json").write_text(json.dumps(model.counts))
    if args.log_indices:
        (args.out / f"{prefix}_indices.json").write_text(json.dumps(model.indices))
        (args.out / f"{prefix}_steps.json").write_text(json.dumps(model.step_rounds))
    (args.out / f"{prefix}_after_fit.json").write_text(json.dumps(
        {"global_step": trainer.global_step, "model_hash": strategy.model_hash, "callback_metrics": after,
         "last_round": strategy.last_result.round if strategy.last_result else -1}))


if __name__ == "__main__":
    main()
