"""What checking a round's result for NaN/Inf before applying it costs the coordinator.

``CoordinatorModel.close_round`` quantizes the sync and checks θ + sync per chunk without writing θ, then applies
it and digests the hash in a second pass. This times it against the single fused pass it replaced (quantize,
apply and hash together, no check; rebuilt here from the same kernels), on one model, in the same run.

    python benchmarks/close_round.py [--numel 25e6] [--dtype float32] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_nodeox.coordinator.model import CoordinatorModel
from lightning_nodeox.core.codec import encode_sync_and_apply
from lightning_nodeox.core.hashing import RowHasher, combine
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import Q4Settings
from lightning_nodeox.core.specs import spec_of


def fused_close(model: CoordinatorModel) -> str:
    """The former close: one pass that quantizes, applies and hashes, with no check."""
    hashers = [RowHasher(t) for t in model.tensors]
    message = model._free_sync_buffer()

    def work(k, i: int, start: int, stop: int) -> None:
        fused = hashers[i] if hashers[i].fusable(model.pool.chunk) else None
        encode_sync_and_apply(k, model.acc[i], 1.0, model.tensors[i].view(-1), message.codes(i), message.scales(i),
                              start=start, stop=stop, hasher=fused)

    model.pool.over_ranges([a.numel() for a in model.acc], work)
    model.pool.run([t for h in hashers if not h.fusable(model.pool.chunk) for t in h.tasks()])
    return combine(model.named(), hashers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=25e6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = int(args.numel)
    dtype = getattr(torch, args.dtype)
    settings = Q4Settings()
    pool = WorkerPool(settings, "cpu", args.threads)
    named = [("w", (torch.randn(n) * 0.1).to(dtype))]
    model = CoordinatorModel(spec_of(named), [t for _, t in named], settings, pool)
    times = {"fused_s": [], "checked_s": []}
    for _ in range(args.repeats):  # interleaved, so both see the same machine
        for acc in model.acc:
            acc.uniform_(-1e-3, 1e-3)
        start = time.perf_counter()
        fused_close(model)
        times["fused_s"].append(time.perf_counter() - start)
        model.moving.update(range(len(model.specs)))  # as if one delta of every tensor, weight 1, came in
        model.weights = [1] * len(model.specs)
        model.weight = 1
        start = time.perf_counter()
        closed = model.close_round(0)
        times["checked_s"].append(time.perf_counter() - start)
        assert not closed.not_finite
        model.publish(closed.sync)
    figures = {k: min(v) for k, v in times.items()}
    figures["ratio"] = figures["checked_s"] / figures["fused_s"]
    figures.update(numel=n, dtype=args.dtype, threads=args.threads)
    pool.close()
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"{n / 1e6:.0f}M {args.dtype} values, {args.threads} thread(s): fused pass {figures['fused_s']:.3f} s, "
              f"checked two passes {figures['checked_s']:.3f} s ({figures['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
