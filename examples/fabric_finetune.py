"""Fine-tune under Lightning Fabric with NodeoxFabricStrategy: one host of a run, a LitGPT-style training loop.

The loop is Fabric's own (``fabric.setup``, ``fabric.backward``, ``optimizer.step``, gradient accumulation,
``fabric.all_reduce`` of the loss every --log-interval steps), with the three lines a run of several hosts needs:
the strategy, a check of ``fabric.strategy.should_stop`` (the run is complete: this host reached the strategy's
``max_steps``, or another host's loop ended), and ``fabric.strategy.finish()`` at the end (this host's final round,
unless the run is complete already: every host ends on the same model). It stops
early, on every host alike, when the held-out loss shared across hosts has not improved for --patience evaluations.

Data: scikit-learn's digits (offline): ``fabric.setup_dataloaders`` gives the shuffled train loader the coordinator's
data ledger's sampler, which shares out each epoch among the hosts (each sample once per epoch, as DDP's
DistributedSampler does; a pass over the loader is this host's share, and its round closes at the pass's end by
itself); the held-out loader keeps its order (every host evaluates all of it). Model: a small MLP with random
weights (the same on every host), or any timm model with --model.

    nodeox launch --hosts 2 --run-dir runs/fabric -- python examples/fabric_finetune.py
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from lightning.fabric import Fabric
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_nodeox import NodeoxFabricStrategy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", help="'mlp', or a timm model name taking 8x8 grey images "
                   "(e.g. resnet10t; random weights, nothing is downloaded)")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps of this host at most")
    p.add_argument("--local-steps", type=int, default=20, help="optimizer steps per host between exchanges")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch size")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--log-interval", type=int, default=20, help="steps between shared training-loss lines")
    p.add_argument("--eval-interval", type=int, default=40, help="steps between evaluations on held-out data")
    p.add_argument("--patience", type=int, default=3, help="evaluations without improvement before stopping")
    p.add_argument("--precision", default="32-true", help="Fabric precision, e.g. bf16-mixed on GPUs")
    return p.parse_args()


def datasets() -> tuple[TensorDataset, TensorDataset]:
    """The training digits (4/5, shared out among the hosts by the coordinator), and the held-out fifth."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    images = torch.tensor(x, dtype=torch.float32)[order].view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y)[order]
    held_out = len(y) // 5
    train = TensorDataset(images[held_out:], labels[held_out:])
    return train, TensorDataset(images[:held_out], labels[:held_out])


def make_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                             nn.Linear(128, 10))
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, in_chans=1)


@torch.no_grad()
def validate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> tuple[torch.Tensor, float]:
    model.eval()
    losses, correct, seen = [], 0, 0
    for x, y in loader:
        logits = model(x)
        losses.append(nn.functional.cross_entropy(logits, y))
        correct += int((logits.argmax(-1) == y).sum())
        seen += len(y)
    model.train()
    return torch.stack(losses).mean(), correct / seen


def main() -> None:
    args = parse_args()
    host = int(os.environ.get("NODEOX_HOST_ID", "0"))
    strategy = NodeoxFabricStrategy(local_steps=args.local_steps, max_steps=args.max_steps)  # max_steps: final round
    fabric = Fabric(devices=1, precision=args.precision, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)  # the same initial weights on every host (the first host's are the run's anyway)

    with fabric.init_module():
        model = make_model(args.model)
    model = fabric.setup_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.02)
    optimizer = fabric.setup_optimizers(optimizer)  # (load pretrained weights here: the first step joins the run)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    train, held_out = datasets()
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True),
        DataLoader(held_out, batch_size=256))

    step, micro, running, best, bad_evals = 0, 0, [], math.inf, 0
    done = False
    while not done:
        for x, y in train_loader:
            micro += 1
            is_accumulating = micro % args.accumulate != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = nn.functional.cross_entropy(model(x), y)
                fabric.backward(loss / args.accumulate)
            running.append(loss.detach())
            if is_accumulating:
                continue
            optimizer.step()  # the first joins the run; every local_steps steps a round closes here
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            if step % args.log_interval == 0:
                shared = fabric.all_reduce(torch.stack(running).mean())  # across hosts, as of the last round
                fabric.print(f"host {host} step {step}: train loss {float(torch.stack(running).mean()):.4f}, "
                             f"across hosts {float(shared):.4f}")
                running = []
            if step % args.eval_interval == 0:
                val_loss, accuracy = validate(fabric, model, val_loader)
                shared = float(fabric.all_reduce(val_loss))  # the same value on every host at this step
                fabric.print(f"host {host} step {step}: held-out loss {float(val_loss):.4f} (across hosts "
                             f"{shared:.4f}), accuracy {accuracy:.3f}")
                best, bad_evals = (shared, 0) if shared < best else (best, bad_evals + 1)
                if bad_evals >= args.patience:
                    fabric.print(f"host {host}: no improvement in {args.patience} evaluations, stopping")
                    done = True
            if done or strategy.should_stop:  # the run is complete: max_steps here, or another host's loop ended
                done = True
                break

    final_hash = strategy.finish()  # this host's final round; then every host holds the run's final model
    _, accuracy = validate(fabric, model, val_loader)
    fabric.save("final.ckpt", {"model": model, "step": step})  # under nodeox launch: RUN_DIR/hosts/host<id>/
    fabric.print(f"host {host}: {step} steps, final model {final_hash}, held-out accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
