"""The same-bytes table (issue 32): on the language model of benchmarks/lm.py, each codec at its own best setting
and at one byte budget, against DDP and fp32 DiLoCo, and each codec without error feedback; long runs, resumable.

Rows are data (:data:`ROWS`): a name, a codec and its settings, local steps, error feedback, the outer optimizer's
flags, and for a matched row the knob it varies to meet the budget. A row whose codec this lightning_nodeox does not
know (int8, fp8 before they land) is skipped with a line saying so.

Each (row, seed) is one process of benchmarks/convergence.py (``--workload lm --define-mode ROW --eval-every H``):
two hosts, bytes per host from their upload records, wall time of the slower host's fit, the validation loss at
every round's end (the curve) and at the run's end. Its result is appended to the results file (``--results``,
JSON lines) as it ends; run again on the same file, the table resumes: a (row, seed) already there under the same
plan (the row as planned, steps, batch size, learning rate) is not run again, a failed one is.

Matched bytes: the budget is ``--budget`` times the q4 row's planned upload bytes over the run (default 0.5); a
matched row varies its local steps (its rounds) or its density so that its planned bytes, rounds x the bytes of
its delta message on the model's tensors (benchmarks/lm.py's TinyGPT, the workload convergence.py's hosts train),
come nearest the budget. Measured bytes are in the table.

Seeds: ``--seeds`` a row (default 3), but a row of more than :data:`LONG_ROUNDS` rounds runs ``--long-seeds``
(default 1); the table says which.

    python benchmarks/codec_table.py [--steps 1000] [--seeds 3] [--long-seeds 1] [--budget 0.5] [--rows a,b,...]
                                     [--results FILE] [--plan]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO, SampleLog, add_results_option, process_env

STEPS = 1000  # optimizer steps per host
LOCAL_STEPS = 20
BATCH_SIZE = 8
LR = 1e-3
SEEDS = 3
LONG_ROUNDS = 200  # a row of more rounds is long: it runs --long-seeds
BUDGET = 0.5  # the matched rows' bytes, as a share of the q4 row's


def nesterov(lr: float, momentum: float) -> tuple[str, ...]:
    """The coordinator's flags for Nesterov's outer step at ``lr`` and ``momentum``."""
    return ("--outer-optimizer", "nesterov", "--outer-lr", f"{lr:g}", "--outer-momentum", f"{momentum:g}")


DILOCO = nesterov(0.7, 0.9)  # DiLoCo's setting
# the outer-optimizer sweep (fp32, so that only the outer step differs from the fp32 row): in steady state a step
# is lr/(1-momentum) times the mean delta (DiLoCo's: 7x; plain averaging: 1x); the sweep spans 3x to 1.4x, then
# holds it at 1x with a short and a long momentum (is it the larger step that costs, or the momentum's memory?)
OUTER_SWEEP = ((0.3, 0.9), (1.0, 0.5), (0.7, 0.5), (0.5, 0.5), (0.1, 0.9))
CONVERGENCE = Path(__file__).with_name("convergence.py")
KNOBS = ("local_steps", "density")  # what a matched row may vary
SPARSELOCO = {"chunking": "tiles"}  # SparseLoCo's recipe as written (--codec sparse cuts runs of 4096 instead)
# SparseLoCo's ingredients one at a time as they were before the recipe: the recipe as written with one of them back
# (the chunking's: the sparse row, --codec sparse)
SPARSE_EARLIER = (("mean", "deltas"), ("error_decay", 1.0), ("levels", "q2"))


@dataclass(frozen=True)
class Row:
    """A row of the table. ``codec`` None: DDP; ``matched``: the knob varied to meet the byte budget."""

    name: str
    codec: str | None
    settings: dict = field(default_factory=dict)
    local_steps: int = LOCAL_STEPS
    error_feedback: bool = True
    outer: tuple[str, ...] = ()
    matched: str | None = None


# each codec at its own best setting known (sparse: SparseLoCo's recipe in runs of 4096, its default; sparse_tiles:
# the recipe as written)
BEST = (("q4", "q4", {}), ("q2_b256", "q2", {"block_size": 256}), ("int8", "int8", {}), ("fp8", "fp8", {}),
        ("sparse", "sparse", {}), ("sparse_tiles", "sparse", SPARSELOCO))
ROWS: tuple[Row, ...] = (
    Row("ddp", None),
    Row("fp32_diloco", "fp32", outer=DILOCO),
    Row("fp32", "fp32"),
    *(Row(name, codec, settings) for name, codec, settings in BEST),
    *(Row(f"{name}_matched", codec, settings, matched="density" if codec == "sparse" else "local_steps")
      for name, codec, settings in BEST),
    Row("fp32_matched", "fp32", matched="local_steps"),
    *(Row(f"{name}_no_ef", codec, settings, error_feedback=False) for name, codec, settings in BEST),
    *(Row(f"fp32_nesterov_{lr:g}_{mu:g}", "fp32", outer=nesterov(lr, mu)) for lr, mu in OUTER_SWEEP),
    *(Row(f"sparse_{knob}_{value:g}" if isinstance(value, float) else f"sparse_{knob}_{value}", "sparse",
          {**SPARSELOCO, knob: value}) for knob, value in SPARSE_EARLIER),
)


@dataclass(frozen=True)
class Planned:
    """A row as it runs: its local steps and settings (a matched row's knob set), rounds, planned upload bytes per
    host, seeds; ``skipped``: why it does not run."""

    row: Row
    local_steps: int
    settings: dict
    rounds: int
    planned_bytes: int | None
    seeds: tuple[int, ...]
    skipped: str | None = None
    same_as: str | None = None  # a matched row that needs no change of its codec's best row: that row's results

    def key(self, steps: int) -> dict:
        """What names this row's results in the results file (a different plan runs again)."""
        return {"row": self.row.name, "codec": self.row.codec, "settings": self.settings, "local_steps":
                self.local_steps, "error_feedback": self.row.error_feedback, "outer": list(self.row.outer),
                "steps": steps, "batch_size": BATCH_SIZE, "lr": LR}


MessageBytes = Callable[[str, dict], "int | None"]  # (codec, settings) -> a delta's bytes (None: codec unknown)


def rounds_of(steps: int, local_steps: int) -> int:
    return -(-steps // local_steps)


def plan(rows: tuple[Row, ...], *, steps: int, seeds: int, long_seeds: int, budget: float,
         message_bytes: MessageBytes) -> list[Planned]:
    """Each row as it runs: matched rows' knobs set to come nearest ``budget`` x the q4 row's planned bytes."""
    q4 = next(r for r in ROWS if r.name == "q4")
    target = budget * rounds_of(steps, q4.local_steps) * message_bytes(q4.codec, q4.settings)
    out = []
    for row in rows:
        h, settings = row.local_steps, dict(row.settings)
        size = None if row.codec is None else message_bytes(row.codec, settings)
        if row.codec is not None and size is None:
            out.append(Planned(row, h, settings, 0, None, (), f"codec {row.codec!r} is not in this lightning_nodeox"))
            continue
        if row.matched == "local_steps":
            h = min(range(1, steps + 1), key=lambda k: abs(math.log(rounds_of(steps, k) * size / target)))
        elif row.matched == "density":
            settings["density"] = _matched_density(row, settings, rounds_of(steps, h), target, message_bytes)
            size = message_bytes(row.codec, settings)
        elif row.matched is not None:
            raise ValueError(f"row {row.name}: matched={row.matched!r}; a matched row varies one of {KNOBS}")
        rounds = rounds_of(steps, h)
        n = long_seeds if rounds > LONG_ROUNDS else seeds
        same = next((o.row.name for o in out if row.matched and o.row.codec == row.codec and not o.row.matched and
                     o.row.error_feedback and not o.row.outer and (o.local_steps, o.settings) == (h, settings)), None)
        out.append(Planned(row, h, settings, rounds, None if size is None else rounds * size, tuple(range(n)),
                           same_as=same))
    return out


def _matched_density(row: Row, settings: dict, rounds: int, target: float, message_bytes: MessageBytes) -> float:
    """The density (k of each chunk of 4096) whose delta's bytes over ``rounds`` come nearest ``target``."""
    from lightning_nodeox.core.codecs.settings import DENSITY_RANGE

    low, high = math.ceil(DENSITY_RANGE[0] * 4096), math.floor(DENSITY_RANGE[1] * 4096)

    def miss(k: int) -> float:
        return abs(math.log(rounds * message_bytes(row.codec, {**settings, "density": k / 4096}) / target))

    while high - low > 2:  # bytes grow with k: narrow to the two around the target
        mid = (low + high) // 2
        if rounds * message_bytes(row.codec, {**settings, "density": mid / 4096}) < target:
            low = mid
        else:
            high = mid
    return min(range(low, high + 1), key=miss) / 4096


def lm_message_bytes() -> MessageBytes:
    """A delta message's bytes on benchmarks/lm.py's model, for a codec and its settings (None: a codec this
    lightning_nodeox does not know)."""
    import lm

    from lightning_nodeox.core.codecs.settings import CODEC_NAMES, settings_for
    from lightning_nodeox.core.specs import spec_of
    from lightning_nodeox.core.wire import MessageLayout

    specs = spec_of([(n, p.detach()) for n, p in lm.TinyGPT().named_parameters()])

    def size(codec: str, settings: dict) -> int | None:
        if codec not in CODEC_NAMES:
            return None
        return MessageLayout.of(specs, settings_for(codec, **settings)).total

    return size


# -- results: what is there, what runs -----------------------------------------------------------------------------


def read_results(path: Path) -> list[dict]:
    """The results file's lines (none when it is not there yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def done(planned: Planned, steps: int, lines: list[dict]) -> dict[int, dict]:
    """The seeds of ``planned`` already run under its plan: seed -> result (failed runs are not done; a row the same
    as another: that row's, under its own plan)."""
    key = planned.key(steps)
    if planned.same_as:
        key = {**key, "row": planned.same_as}
    return {line["seed"]: line["result"] for line in lines if line.get("plan") == key and "result" in line}


def to_run(plans: list[Planned], steps: int, lines: list[dict]) -> list[tuple[Planned, int]]:
    """The (row, seed) runs still to do, in the table's order (none of a row the same as another)."""
    return [(p, seed) for p in plans if not p.skipped and not p.same_as for seed in p.seeds
            if seed not in done(p, steps, lines)]


def convergence_command(planned: Planned, seed: int, steps: int, results: Path) -> list[str]:
    """benchmarks/convergence.py's command line for one seed of a row."""
    row = planned.row
    cmd = [sys.executable, str(CONVERGENCE), "--workload", "lm", "--json", "--seeds", "1", "--first-seed", str(seed),
           "--steps", str(steps), "--batch-size", str(BATCH_SIZE), "--lr", str(LR), "--local-steps",
           str(planned.local_steps), "--eval-every", str(planned.local_steps), "--results", str(results)]
    if row.codec is None:
        return [*cmd, "--modes", "ddp"]
    flags = [x for k, v in planned.settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    mode = {"name": row.name, "coordinator": ["--codec", row.codec, *flags, *row.outer],
            "strategy": {} if row.error_feedback else {"error_feedback": False}, "local_steps": planned.local_steps}
    return [*cmd, "--without-ddp", "--define-mode", json.dumps(mode), "--modes", row.name]


def run_one(planned: Planned, seed: int, steps: int, timeout: float) -> dict:
    """One seed of a row: its convergence.py run's result (a RuntimeError naming why when there is none)."""
    with tempfile.TemporaryDirectory(prefix="nodeox-codec-table-") as tmp:
        done_ = subprocess.run(convergence_command(planned, seed, steps, Path(tmp) / "runs.jsonl"),
                               capture_output=True, text=True, timeout=timeout, cwd=REPO, env=process_env(),
                               check=False)
    if done_.returncode != 0:
        raise RuntimeError(f"convergence.py exited with {done_.returncode}: {done_.stderr[-3000:]}")
    mode = json.loads(done_.stdout)["modes"][planned.row.name]
    if not mode.get("runs"):
        raise RuntimeError(f"{mode.get('status')}: {mode.get('reason') or mode.get('errors')}")
    return mode["runs"][0]


# -- the table -----------------------------------------------------------------------------------------------------


def table(plans: list[Planned], steps: int, lines: list[dict], seeds: int) -> list[str]:
    """The markdown table of the rows' results so far (a row without any: its line says so)."""
    base = done(next(p for p in plans if p.row.name == "q4"), steps, lines) if any(
        p.row.name == "q4" for p in plans) else {}
    q4_bytes = statistics.mean(r["bytes_per_host"] for r in base.values()) if base else None
    out = ["| row | codec, settings | local steps (rounds) | error feedback | seeds | final val loss, mean (min–max) "
           "| stdev | bytes/host | vs q4 | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        row = p.row
        knobs = [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in p.settings.items()]
        what = "DDP" if row.codec is None else ", ".join([row.codec, *knobs, *([" ".join(row.outer)] if row.outer
                                                                               else [])])
        what += f" (= {p.same_as})" if p.same_as else ""
        steps_text = "every step" if row.codec is None else f"{p.local_steps} ({p.rounds})"
        ef = "-" if row.codec is None else "on" if row.error_feedback else "off"
        if p.skipped:
            out.append(f"| {row.name} | {what} | {steps_text} | {ef} | - | skipped: {p.skipped} | | | | |")
            continue
        results = done(p, steps, lines)
        count = f"{len(results)} of {len(p.seeds)}" + (" (long row)" if len(p.seeds) < seeds else "")
        if not results:
            out.append(f"| {row.name} | {what} | {steps_text} | {ef} | {count} | not run yet | | | | |")
            continue
        losses = [r["val_loss"] for r in results.values()]
        sent = statistics.mean(r["bytes_per_host"] for r in results.values())
        ratio = f"{sent / q4_bytes:.3f}x" if q4_bytes else "-"
        stdev = f"{statistics.stdev(losses):.4f}" if len(losses) > 1 else "-"
        same = "" if all(r.get("hosts_identical", True) for r in results.values()) else " (hosts differ!)"
        out.append(f"| {row.name} | {what} | {steps_text} | {ef} | {count} | {statistics.mean(losses):.4f} "
                   f"({min(losses):.4f}–{max(losses):.4f}){same} | {stdev} | {_mb(sent)} | {ratio} | "
                   f"{statistics.mean(r['wall_s'] for r in results.values()):.0f} |")
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per host (default {STEPS})")
    p.add_argument("--seeds", type=int, default=SEEDS, help=f"seeds a row (default {SEEDS})")
    p.add_argument("--long-seeds", type=int, default=1, help=f"seeds a row of more than {LONG_ROUNDS} rounds "
                   "(default 1)")
    p.add_argument("--budget", type=float, default=BUDGET, help="the matched rows' bytes, times the q4 row's "
                   f"(default {BUDGET})")
    p.add_argument("--rows", help=f"comma-separated, of {','.join(r.name for r in ROWS)} (default: all)")
    p.add_argument("--plan", action="store_true", help="print the rows as they would run, and run none")
    add_results_option(p)
    args = p.parse_args()
    wanted = [r.strip() for r in args.rows.split(",")] if args.rows else [r.name for r in ROWS]
    unknown = sorted(set(wanted) - {r.name for r in ROWS})
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {[r.name for r in ROWS]}")
    results = args.results or Path(tempfile.gettempdir()) / "nodeox-codec-table.jsonl"
    plans = plan(tuple(r for r in ROWS if r.name in wanted), steps=args.steps, seeds=args.seeds,
                 long_seeds=args.long_seeds, budget=args.budget, message_bytes=lm_message_bytes())
    for planned in plans:
        if planned.skipped:
            print(f"{planned.row.name}: skipped, {planned.skipped}", flush=True)
        else:
            sent = "-" if planned.planned_bytes is None else _mb(planned.planned_bytes)
            print(f"{planned.row.name}: {json.dumps(planned.settings)} local_steps {planned.local_steps}, "
                  f"{planned.rounds} rounds, planned {sent} a host, seeds {list(planned.seeds)}"
                  + (f", the same run as {planned.same_as}" if planned.same_as else ""), flush=True)
    pending = to_run(plans, args.steps, read_results(results))
    print(f"results: {results}; {len(pending)} run(s) to do", flush=True)
    if not args.plan:
        log = SampleLog("codec_table", results)
        timeout = 3600 * max(1.0, args.steps / STEPS)
        for planned, seed in pending:
            print(f"{planned.row.name} seed {seed} ...", flush=True)
            with log.sample({"row": planned.row.name, "seed": seed, "plan": planned.key(args.steps)}) as taken:
                taken.result = run_one(planned, seed, args.steps, timeout)
            if taken.result is not None:
                print(f"{planned.row.name} seed {seed}: val loss {taken.result['val_loss']:.4f}, bytes/host "
                      f"{_mb(taken.result['bytes_per_host'])}, wall {taken.result['wall_s']:.0f} s", flush=True)
    long = [pl.row.name for pl in plans if not pl.skipped and len(pl.seeds) < args.seeds]
    print(f"\nlanguage model (benchmarks/lm.py), 2 hosts, {args.steps} steps a host, batch {BATCH_SIZE}, AdamW lr "
          f"{LR:g}; validation loss in nats a byte (lower is better); seeds: {args.seeds} a row"
          + (f", {args.long_seeds} for the rows of more than {LONG_ROUNDS} rounds ({', '.join(long)})" if long else "")
          + f"; matched rows: {args.budget:g}x the q4 row's planned bytes\n")
    print("\n".join(table(plans, args.steps, read_results(results), args.seeds)))


if __name__ == "__main__":
    main()
