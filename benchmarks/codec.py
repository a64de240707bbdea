"""q4 codec speed against one memory copy of the same fp32 data, measured in the same run.

For each size: encode (delta + error feedback, fused), decode, decode+accumulate and model hash on one
thread, each in seconds and as a ratio to copying the same fp32 values once. Then encode of 86M values with
the CPU quota's threads, quiet and while two busy processes keep every core loaded. Then the q4 relative L2
error of Gaussian values for each block size and rounding mode. Goals are printed with MET or MISSED.

    python benchmarks/codec.py [--json] [--sizes 86e6,632e6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from common import spawn, stop

from lightning_nodeox.core.codec import accumulate_tensor, decode_tensor, encode_delta, encode_tensor, relative_error
from lightning_nodeox.core.codecs.blockwise import block_count
from lightning_nodeox.core.codecs.q4 import code_bytes
from lightning_nodeox.core.pool import WorkerPool
from lightning_nodeox.core.codecs.settings import BLOCK_SIZES, Q4Settings
from lightning_nodeox.core.settings import ROUNDINGS
from lightning_nodeox.core.cpu import granted_cpus
from lightning_nodeox.core.hashing import model_hash

GOALS = {"encode": 5.0, "decode_accumulate": 5.0, "hash": 3.0}
STRETCH_ENCODE = 2.0
CONTENTION_GOAL = 3.0


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_with_copy(fn, copy, repeats: int) -> tuple[float, float]:
    """Fastest of ``repeats`` runs of ``fn`` and of the copy, interleaved so both see the same machine."""
    runs, copies = [], []
    for _ in range(repeats):
        copies.append(best(copy, 1))
        runs.append(best(fn, 1))
    return min(runs), min(copies)


def run_tasks(pool: WorkerPool, numel: int, fn) -> None:
    pool.run([lambda k, a=a, b=b: fn(k, a, b) for a, b in pool.split(numel)])


def size_figures(n: int, repeats: int) -> dict:
    settings = Q4Settings()
    pool = WorkerPool(settings, "cpu", threads=1)
    current = torch.empty(n).uniform_(-1, 1)
    base = torch.empty(n).uniform_(-1, 1)
    residual = torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n)
    acc = torch.zeros(n)
    codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
    scales = torch.empty(block_count(n, 64), dtype=torch.float16)
    def copy() -> None:
        out.copy_(current)

    work = {
        "encode": lambda: run_tasks(pool, n, lambda k, a, b: encode_delta(
            k, current, base, residual, codes, scales, start=a, stop=b)),
        "decode": lambda: run_tasks(pool, n, lambda k, a, b: decode_tensor(
            k, codes[a // 2 : a // 2 + -(-(b - a) // 64) * 32], scales[a // 64 : -(-b // 64)], out[a:b])),
        "decode_accumulate": lambda: run_tasks(pool, n, lambda k, a, b: accumulate_tensor(
            k, codes, scales, acc, 0.5, start=a, stop=b)),
        "hash": lambda: model_hash([("values", current)], pool),
    }
    copy()
    seconds, ratios, copies = {}, {}, []
    for name, fn in work.items():
        seconds[name], copy_s = best_with_copy(fn, copy, repeats)
        ratios[name] = seconds[name] / copy_s
        copies.append(copy_s)
    pool.close()
    return {"values": n, "copy_s": min(copies), "seconds": seconds, "ratio_to_copy": ratios}


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [spawn([sys.executable, "-c", "while True: pass"], None) for _ in range(count)]


def contention_figures(n: int, repeats: int) -> dict:
    """Encode with the threads a CPU host would use, quiet and with every core kept busy by other processes."""
    threads = granted_cpus()
    torch.set_num_threads(threads)  # as in a host process: the codec must not depend on it
    pool = WorkerPool(Q4Settings(), "cpu", threads=threads)
    current, base = torch.empty(n).uniform_(-1, 1), torch.empty(n).uniform_(-1, 1)
    residual = torch.zeros(n, dtype=torch.bfloat16)
    codes = torch.empty(code_bytes(n, 64), dtype=torch.uint8)
    scales = torch.empty(block_count(n, 64), dtype=torch.float16)

    def encode() -> None:
        run_tasks(pool, n, lambda k, a, b: encode_delta(k, current, base, residual, codes, scales, start=a, stop=b))

    quiet = best(encode, repeats)
    hogs = busy_processes(threads)
    try:
        time.sleep(0.5)
        loaded = best(encode, repeats)
    finally:
        stop(hogs)
    pool.close()
    torch.set_num_threads(1)
    return {"values": n, "threads": threads, "busy_processes": threads, "quiet_s": quiet, "loaded_s": loaded,
            "slowdown": loaded / quiet}


def error_figures(n: int = 1 << 22) -> dict:
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out, figures = torch.empty(n), {}
    for rounding in ROUNDINGS:
        for bs in BLOCK_SIZES:
            settings = Q4Settings(block_size=bs)
            pool = WorkerPool(settings, "cpu", 1)
            codes = torch.empty(code_bytes(n, bs), dtype=torch.uint8)
            scales = torch.empty(block_count(n, bs), dtype=torch.float16)
            encode_tensor(pool.kernels(), x, codes, scales, seed=1 if rounding == "stochastic" else None)
            decode_tensor(pool.kernels(), codes, scales, out)
            figures[f"{rounding}/{bs}"] = {
                "rel_l2_error": relative_error(x, out),
                "bytes_per_value": (codes.numel() + scales.numel() * 2) / n,
            }
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--sizes", default="86e6,632e6", help="comma-separated value counts")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    report = {"granted_cpus": granted_cpus(), "sizes": [size_figures(n, args.repeats) for n in sizes]}
    report["contention"] = contention_figures(sizes[0], args.repeats)
    report["errors"] = error_figures()
    goals = []
    for fig in report["sizes"]:
        r = fig["ratio_to_copy"]
        for name, limit in GOALS.items():
            goals.append({"goal": f"{name} at {fig['values'] / 1e6:.0f}M values, one thread: <= {limit}x copy",
                          "measured": r[name], "met": r[name] <= limit})
        goals.append({"goal": f"encode at {fig['values'] / 1e6:.0f}M values (stretch): <= {STRETCH_ENCODE}x copy",
                      "measured": r["encode"], "met": r["encode"] <= STRETCH_ENCODE})
    c = report["contention"]
    goals.append({"goal": f"encode under CPU contention: <= {CONTENTION_GOAL}x quiet", "measured": c["slowdown"],
                  "met": c["slowdown"] <= CONTENTION_GOAL})
    report["goals"] = goals
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"CPUs granted to this process: {report['granted_cpus']}")
    print(f"{'values':>8} {'copy s':>8} | " + " | ".join(f"{k:>18}" for k in report["sizes"][0]["seconds"]))
    for fig in report["sizes"]:
        cells = [f"{fig['seconds'][k]:7.3f}s {fig['ratio_to_copy'][k]:5.2f}x copy" for k in fig["seconds"]]
        print(f"{fig['values'] / 1e6:7.0f}M {fig['copy_s']:8.3f} | " + " | ".join(f"{c:>18}" for c in cells))
    print(f"\nencode {c['values'] / 1e6:.0f}M values on {c['threads']} codec threads: quiet {c['quiet_s']:.3f}s, "
          f"with {c['busy_processes']} busy processes {c['loaded_s']:.3f}s ({c['slowdown']:.2f}x)")
    print("\nq4 relative L2 error, Gaussian values:")
    for key, e in report["errors"].items():
        print(f"  {key:18} {e['rel_l2_error']:.4f}  ({e['bytes_per_value']:.4f} bytes/value)")
    print("\ngoals:")
    for g in goals:
        print(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.2f}")


if __name__ == "__main__":
    main()
