"""Coordinator memory per outer optimizer, at a real model's size: the coordinator's own tensor work, in a process
of its own per optimizer (θ from a model file in memory, two hosts' q4 deltas accumulated, three rounds closed).

Printed: peak RSS beyond the process's PyTorch baseline, as a multiple of the fp32 model, for plain averaging
and for Nesterov (one more fp32 buffer per tensor), and the time a round's close takes with each.

    python benchmarks/coordinator_memory.py [--model vit_huge_patch14_224] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(model: str, outer: str) -> dict:
    import torch

    from lightning_nodeox.coordinator.config import OuterSettings
    from lightning_nodeox.coordinator.model import CoordinatorModel
    from lightning_nodeox.core.codec import encode_tensor
    from lightning_nodeox.core.codecs import codec_for
    from lightning_nodeox.core.pool import WorkerPool
    from lightning_nodeox.core.codecs.settings import Q4Settings
    from lightning_nodeox.core.specs import spec_of
    from lightning_nodeox.core.wire import MessageLayout, Message, MessageMeta

    from common import model_shapes, rss

    torch.set_num_threads(1)
    baseline = rss()
    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.empty(s).uniform_(-0.05, 0.05, generator=gen)) for n, s in model_shapes(model)]
    model_bytes = sum(t.numel() * 4 for _, t in named)
    specs, settings = spec_of(named), Q4Settings()
    pool = WorkerPool(settings, "cpu", 1)
    coordinator = CoordinatorModel(specs, [t for _, t in named], settings, pool, OuterSettings(outer))
    del named
    delta = Message.allocate(MessageLayout.of(specs, settings))
    k = codec_for(settings).kernels()
    for i, s in enumerate(specs):
        encode_tensor(k, torch.randn(s.numel, generator=gen) * 1e-3, delta.codes(i), delta.scales(i))
    delta.write_header(MessageMeta("delta", 0, "h", coordinator.hash, samples=32))
    closes = []
    for r in range(3):
        coordinator.accumulate(delta, 32)
        coordinator.accumulate(delta, 32)
        start = time.perf_counter()
        coordinator.publish(coordinator.close_round(r))
        closes.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pool.close()
    return {"outer": outer, "model_bytes": model_bytes, "baseline_rss": baseline, "peak_rss": peak,
            "peak_beyond_baseline_x_model": (peak - baseline) / model_bytes, "close_round_s": min(closes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_huge_patch14_224")
    p.add_argument("--json", action="store_true")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.model, args.measure)))
        return
    results = []
    for outer in ("average", "nesterov"):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--measure", outer],
                             capture_output=True, text=True, timeout=1800, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gib = 2**30
    print(f"{args.model}: fp32 model {results[0]['model_bytes'] / gib:.2f} GiB")
    for r in results:
        print(f"  {r['outer']:9} peak RSS {r['peak_rss'] / gib:6.2f} GiB = {r['peak_beyond_baseline_x_model']:.2f}x model "
              f"beyond PyTorch's {r['baseline_rss'] / gib:.2f} GiB; a round's close {r['close_round_s']:.2f} s")
    extra = results[1]["peak_rss"] - results[0]["peak_rss"]
    print(f"  nesterov costs {extra / gib:.2f} GiB more ({extra / results[0]['model_bytes']:.2f}x model)")


if __name__ == "__main__":
    main()
