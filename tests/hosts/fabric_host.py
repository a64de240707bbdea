"""A test host under Lightning Fabric: a small MLP on scikit-learn's digits, trained with NodeoxFabricStrategy.

Each step it shares its loss with ``fabric.all_reduce`` and records its own value, what came back and the last
round it applied; ``--stop-host H --stop-step S``: host H ends its loop after S steps (an early stop decided on
one host). With ``--ledger`` the coordinator's data ledger shares out the data (``setup_dataloaders``'s default
``use_distributed_sampler=True``; else each host reads all of it in its own order), the loop runs ``--passes``
passes over the loader (or until ``--max-steps``), and ``--log-indices`` writes each pass's trained sample indices
to OUT/host<id>_indices.json as [pass, index]. At the end it calls ``fabric.strategy.finish()``, saves its model
with ``fabric.save("final.ckpt")`` (under ``nodeox launch``: in its own run folder) and writes OUT/host<id>.json.
Started by `nodeox launch` in tests.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxFabricStrategy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--stop-host", default="")
    p.add_argument("--stop-step", type=int, default=0)
    p.add_argument("--overlap", default="off", choices=("off", "eager", "delayed"))
    p.add_argument("--ledger", action="store_true", help="the coordinator's data ledger shares out the data")
    p.add_argument("--passes", type=int, default=1_000_000, help="passes over the loader at most")
    p.add_argument("--log-indices", action="store_true", help="write [pass, index] of each sample trained")
    args = p.parse_args()
    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    torch.manual_seed(100 + int(host))  # hosts start different: the run's first host provides the model
    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y), torch.arange(len(y)))
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(int(host)))

    fabric = Fabric(accelerator="cpu", devices=1,
                    strategy=NodeoxFabricStrategy(local_steps=args.local_steps, cpu_threads=1, codec_threads=1,
                                                  overlap=False if args.overlap == "off" else args.overlap))
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=args.ledger)
    strategy = fabric.strategy
    records, indices, steps, stopped, passes = [], [], 0, False, 0
    while steps < args.max_steps and not stopped and passes < args.passes:
        passes += 1
        for xb, yb, ib in loader:
            indices += [[passes - 1, int(i)] for i in ib]
            loss = nn.functional.cross_entropy(model(xb), yb)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            own = loss.detach()
            shared = fabric.all_reduce(own)
            last = strategy.last_result
            records.append({"step": steps, "own": float(own), "shared": float(shared),
                            "round": last.round if last else -1})
            if host == args.stop_host and steps == args.stop_step:
                stopped = True  # an early stop decided here alone
            if stopped or strategy.should_stop or steps >= args.max_steps:
                stopped = True
                break
    final_hash = strategy.finish()
    fabric.save("final.ckpt", {"model": model})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.log_indices:
        (args.out / f"host{host}_indices.json").write_text(json.dumps(indices))
    (args.out / f"host{host}.json").write_text(json.dumps(
        {"steps": steps, "model_hash": final_hash, "should_stop": strategy.should_stop, "records": records,
         "last_round": strategy.last_result.round}))


if __name__ == "__main__":
    main()
