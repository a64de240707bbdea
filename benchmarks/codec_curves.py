"""The long-run curves of benchmarks/codec_table.py as a PNG: each row's validation loss at every round's end (host
0's evaluations, the mean over the seeds run), against the optimizer steps a host took.

    python benchmarks/codec_curves.py RESULTS.jsonl [--rows q4,sparse,...] [--out docs/codec-curves.png]

Only results under the table's current plan are drawn (as ``codec_table.py`` prints them): a row's older results,
run under another plan, are not.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from codec_table import ROWS, STEPS, done, lm_message_bytes, plan, read_results

DEFAULT_ROWS = ("ddp", "fp32", "fp32_diloco", "q4", "q2_b256", "int8", "sparse", "sparse_tiles", "sparse_no_ef")


def mean_curve(results: dict[int, dict]) -> list[tuple[int, float]]:
    """The seeds' curves averaged at the steps every seed evaluated at (step, mean validation loss)."""
    curves = [{step: m["val_loss"] for step, m in r.get("curve", [])} for r in results.values()]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return [(s, statistics.mean(c[s] for c in curves)) for s in steps]


def curves(lines: list[dict], rows: list[str], steps: int) -> dict[str, tuple[int, list[tuple[int, float]]]]:
    """Row name -> (seeds, its mean curve), for the rows in ``rows`` with results under the current plan."""
    plans = plan(tuple(r for r in ROWS if r.name in rows), steps=steps, seeds=3, long_seeds=1, budget=0.5,
                 message_bytes=lm_message_bytes())
    out = {}
    for p in plans:
        results = {seed: r for seed, r in done(p, steps, lines).items() if r.get("curve")}
        if results:
            out[p.row.name] = (len(results), mean_curve(results))
    return out


def draw(found: dict[str, tuple[int, list[tuple[int, float]]]], out: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (whole, tail) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, (seeds, points) in found.items():
        xs, ys = zip(*points)
        for ax in (whole, tail):
            ax.plot(xs, ys, label=f"{name} ({seeds} seed{'s' if seeds > 1 else ''})", linewidth=1.2)
    whole.set_title("validation loss, whole run")
    tail.set_title("the second half")
    tail.set_xlim(steps // 2, steps)
    ends = [y for _, pts in found.values() for x, y in pts if x >= steps // 2]
    if ends:
        tail.set_ylim(min(ends) - 0.02, max(ends) + 0.02)
    for ax in (whole, tail):
        ax.set_xlabel("optimizer steps per host")
        ax.set_ylabel("nats a byte")
        ax.grid(alpha=0.3)
    tail.legend(fontsize=8)
    fig.suptitle("benchmarks/codec_table.py: language model (benchmarks/lm.py), 2 hosts")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="codec_table.py's results file (JSON lines)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows to draw")
    p.add_argument("--steps", type=int, default=STEPS, help=f"the table's steps per host (default {STEPS})")
    p.add_argument("--out", type=Path, default=Path("docs/codec-curves.png"))
    args = p.parse_args()
    if not args.results.exists():
        p.error(f"{args.results} does not exist; give codec_table.py's --results file")
    rows = [r.strip() for r in args.rows.split(",")]
    unknown = sorted(set(rows) - {r.name for r in ROWS})
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {[r.name for r in ROWS]}")
    found = curves(read_results(args.results), rows, args.steps)
    if not found:
        p.error(f"no row of {rows} has a curve in {args.results} under the current plan")
    draw(found, args.out, args.steps)
    print(f"{args.out}: {', '.join(f'{n} ({s})' for n, (s, _) in found.items())}")


if __name__ == "__main__":
    main()
