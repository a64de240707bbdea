"""What following rank 0 costs the other ranks of a host (lightning_nodeox/host/ranks.py), at a real model's size.

Two ranks on this machine in a gloo process group (a CPU host; on GPUs the tensors go over NCCL instead) measure:
- ``decide``: rank 0's per-step decision (overlap or a time budget), one broadcast of two integers;
- ``lead_no_model``: a round's outcome alone (a pickled RoundResult-sized value);
- ``lead_model``: an outcome and the model's tensors (what follows each round, fold and join);
and, for comparison, broadcasting only the model's q4 sync message (the bytes a design that applies the sync on
every rank would move).

    python benchmarks/host_ranks.py [--model vit_base_patch16_224] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn`` on this rank, the ranks lined up before each try."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, port: int, model: str, repeats: int, queue) -> None:
    from common import model_shapes

    from lightning_nodeox.core.codecs.settings import Q4Settings
    from lightning_nodeox.core.specs import spec_of
    from lightning_nodeox.core.wire import MessageLayout
    from lightning_nodeox.host.ranks import HostRanks
    from lightning_nodeox.host.round import RoundResult

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    named = [(n, torch.zeros(s)) for n, s in model_shapes(model)]
    tensors = [t for _, t in named]
    ranks = HostRanks(tensors, per_step=True)
    result = RoundResult(7, "0123456789abcdef0123456789abcdef", False, True)
    sync = torch.zeros(MessageLayout.of(spec_of(named), Q4Settings()).total, dtype=torch.uint8)
    out = {
        "model_bytes": sum(t.numel() * 4 for t in tensors),
        "sync_bytes": sync.numel(),
        "decide_s": timed(lambda: [ranks.decide(False, False) for _ in range(100)], repeats) / 100,
        "lead_no_model_s": timed(lambda: ranks.lead(lambda: result, model=False), repeats),
        "lead_model_s": timed(lambda: ranks.lead(lambda: result), repeats),
        "sync_broadcast_s": timed(lambda: dist.broadcast(sync, src=0), repeats),
    }
    ranks.close()
    dist.destroy_process_group()
    if rank == 1:
        queue.put(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(rank_main, args=(port, args.model, args.repeats, queue), nprocs=2, start_method="spawn")
    r = queue.get(timeout=60)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    gb = 1e9
    print(f"{args.model}: fp32 model {r['model_bytes'] / 1e6:.1f} MB, q4 sync {r['sync_bytes'] / 1e6:.1f} MB "
          f"(gloo, 2 ranks on this machine; seconds on the following rank)")
    print(f"  decide (per step)          {r['decide_s'] * 1e6:8.0f} us")
    print(f"  outcome only               {r['lead_no_model_s'] * 1e3:8.2f} ms")
    print(f"  outcome and model          {r['lead_model_s'] * 1e3:8.2f} ms  "
          f"({r['model_bytes'] / r['lead_model_s'] / gb:.2f} GB/s)")
    print(f"  q4 sync bytes only         {r['sync_broadcast_s'] * 1e3:8.2f} ms  "
          f"({r['sync_bytes'] / r['sync_broadcast_s'] / gb:.2f} GB/s)")


if __name__ == "__main__":
    main()
