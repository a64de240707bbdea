"""What one host process of benchmarks/convergence.py runs (``convergence.py --host ...``, started by DDP's launcher
there or by `nodeox launch`): its workload (digits, below, or benchmarks/lm.py's language model) under NodeoxStrategy
or DDP, its result written to ``OUT/host<ID>.json``."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from convergence_modes import HIDDEN, STALL_SECONDS, TEST_SIZE

UNAVAILABLE_EXIT = 3  # a host's exit status when NodeoxStrategy refuses an option of its mode


def digits_workload(args: argparse.Namespace, host: int):
    """What host ``host`` trains on digits, as (LightningModule, DataLoader, evaluate): the CNN under SGD on its
    share of the training split, and ``evaluate()``, its accuracy on the test split."""
    import torch
    from lightning.pytorch import LightningModule
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=TEST_SIZE, random_state=0, stratify=y)
    x_train, y_train = torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train)
    index = torch.arange(len(y_train))  # each sample's index in the split (the epoch modes log what they trained)
    share = slice(None) if args.ledger else slice(host % args.num_hosts, None, args.num_hosts)  # by hand: its share
    loader = DataLoader(TensorDataset(x_train[share], y_train[share], index[share]), batch_size=args.batch_size,
                        shuffle=True, drop_last=args.host_epochs is None,
                        generator=torch.Generator().manual_seed(1000 * args.seed + host))

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, HIDDEN), nn.ReLU(),
                nn.Linear(HIDDEN, 10))

        def training_step(self, batch, batch_idx):
            xb, yb = batch[0], batch[1]
            return nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=args.lr, momentum=0.9)

    torch.manual_seed(args.seed)  # every process starts from the same model
    model = Net()

    def evaluate() -> dict:
        model.eval()
        with torch.no_grad():
            logits = model.net(torch.tensor(x_test, dtype=torch.float32))
        correct = int((logits.argmax(1) == torch.tensor(y_test)).sum())
        return {"accuracy": correct / len(y_test), "test_samples": len(y_test)}

    return model, loader, evaluate


def split_size() -> int:
    """The digits training split's samples (every epoch mode's epoch)."""
    import math

    from sklearn.datasets import load_digits

    samples = len(load_digits().target)
    return samples - math.ceil(samples * TEST_SIZE)  # as train_test_split cuts it


def host_main(args: argparse.Namespace) -> None:
    """One host: trains its workload for its steps (or epochs) under NodeoxStrategy, or as one rank of DDP, and
    writes its result (its metric, samples, steps, fit time, a digest of its parameters) to ``OUT/host<ID>.json``."""
    import hashlib

    import torch
    from lightning.pytorch import Callback, Trainer

    torch.set_num_threads(1)
    out = Path(args.out)
    nodeox = args.kind == "nodeox"
    host = int(os.environ["NODEOX_HOST_ID"] if nodeox else os.environ["NODE_RANK"])
    strategy_kwargs = json.loads(args.strategy_kwargs)
    steps = int(args.host_steps.split(",")[host])
    if args.workload == "lm":
        import lm

        model, loader, evaluate = lm.workload(host=host, hosts=args.num_hosts, seed=args.seed, steps=steps,
                                              batch_size=args.batch_size, lr=args.lr)
    else:
        model, loader, evaluate = digits_workload(args, host)

    class Count(Callback):
        """Samples trained; sleeps ``pace`` after each batch, and with ``slowdown`` > 1 more, to run that many times
        slower; at the steps ``stalls``, sleeps ``STALL_SECONDS``."""

        def __init__(self, slowdown: float, stalls: set[int], pace: float) -> None:
            self.samples, self.slowdown, self.periods, self.last, self.slept = 0, slowdown, [], None, 0.0
            self.stalls, self.pace = stalls, pace

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.samples += len(batch[0] if isinstance(batch, (list, tuple)) else batch)
            time.sleep(self.pace)
            if trainer.global_step in self.stalls:
                self.stalls.discard(trainer.global_step)
                time.sleep(STALL_SECONDS)
            if self.slowdown <= 1:
                return
            now = time.perf_counter()
            if self.last is not None:  # this batch's period without our own sleep; median: rounds are rare
                self.periods = (self.periods + [now - self.last - self.slept])[-50:]
            self.slept = (self.slowdown - 1) * statistics.median(self.periods) if self.periods else 0.0
            time.sleep(self.slept)
            self.last = now

    class LogTrained(Callback):
        """Each step's ``[round, epoch, indices, time]`` as a line of ``host<id>_trained.jsonl``, flushed: a host
        killed with -9 leaves what it trained (its round: the one its next delta carries, overlap off; its time:
        before the step). A step the strategy skipped (its batch was read under a data lease found void since: it
        returns no output) trained nothing and is not written."""

        def __init__(self) -> None:
            self.file = open(out / f"host{host}_trained.jsonl", "a")  # noqa: SIM115 - open for the run
            self.step: list | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # before the step: its round
            round_ = trainer.strategy._session.link.round.round  # noqa: SLF001 - a benchmark's look inside
            self.step = [round_, trainer.current_epoch, batch[2].tolist(), time.time()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if outputs:  # else the strategy skipped the step: a batch read ahead under a lease found void since
                self.file.write(json.dumps(self.step) + "\n")
                self.file.flush()

    class Curve(Callback):
        """The workload's evaluation every ``every`` steps (a round's end, at ``every = local_steps``), as
        ``[step, metrics]`` pairs; the model is put back in training mode after each."""

        def __init__(self, every: int) -> None:
            self.every, self.points = every, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % self.every == 0:
                self.points.append([trainer.global_step, evaluate()])
                pl_module.train()

    slow = host == args.slow_host
    stalls = set(random.Random(args.seed).sample(range(steps // 5, 4 * steps // 5), args.stalls)) if slow else set()
    count = Count(args.slowdown if slow else 1.0, stalls, args.pace)
    curve = Curve(args.eval_every) if args.eval_every else None
    length = {"max_steps": steps} if args.host_epochs is None else {"max_epochs": args.host_epochs, "max_steps": -1}
    common = {**length, "accelerator": "cpu", "devices": 1, "logger": False,
              "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
              "use_distributed_sampler": args.ledger,
              "callbacks": [count, *([LogTrained()] if args.host_epochs is not None else []),
                            *([curve] if curve else [])]}
    if nodeox:
        from lightning_nodeox import NodeoxStrategy

        try:
            strategy = NodeoxStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1, **strategy_kwargs)
        except (TypeError, ValueError) as e:
            (out / f"host{host}.json").write_text(json.dumps({"unavailable": f"NodeoxStrategy: {e}"}))
            raise SystemExit(UNAVAILABLE_EXIT) from None
        trainer = Trainer(strategy=strategy, **common)
    else:
        from datetime import timedelta

        from lightning.pytorch.strategies import DDPStrategy

        class FileStoreDDP(DDPStrategy):
            """DDP over gloo whose rendezvous is a file: no TCP store listening on every interface."""

            def setup_distributed(self) -> None:
                self.set_world_ranks()
                self._process_group_backend = "gloo"
                torch.distributed.init_process_group("gloo", init_method=f"file://{args.store}", rank=self.global_rank,
                                                     world_size=self.world_size, timeout=self._timeout)

        trainer = Trainer(strategy=FileStoreDDP(process_group_backend="gloo", timeout=timedelta(seconds=60)),
                          num_nodes=args.num_hosts, **common)
    if args.join_when is not None:  # a host that joins later: started (imports done), it joins once told
        while not Path(args.join_when).exists():
            time.sleep(0.05)
    start = time.time()
    trainer.fit(model, loader)
    fit_wall = time.time() - start
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    result = {
        "host": host, **evaluate(), "samples": count.samples,
        "steps": trainer.global_step, "fit_start": start, "fit_wall_s": fit_wall,
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()), "param_digest": digest,
        "model_hash": getattr(trainer.strategy, "model_hash", None) if nodeox else None,
        **({"curve": curve.points} if curve else {}),
    }
    (out / f"host{host}.json").write_text(json.dumps(result))
