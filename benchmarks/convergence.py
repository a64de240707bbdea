"""Convergence: Nodeox against DDP on real data that ships offline, 2 hosts on this machine (4 in the relay rows),
on one of two workloads (``--workload``): scikit-learn's digits (the default, below), or ``lm``, a 3.3M-parameter
byte-level causal transformer trained on the Python standard library's own source (benchmarks/lm.py: AdamW lr
1e-3, batch 8 windows of 128 bytes, 240 steps per host), reporting validation loss (nats per byte; lower is
better) and perplexity instead of accuracy.

Every mode trains the same model (a small CNN: two 3x3 convolutions of 32 and 64 channels, 2x2 max-pooling, a
128-unit hidden layer; 151K parameters) with the same inner optimizer (SGD, lr 0.02, momentum 0.9),
the same batch size per host (32) and the same number of optimizer steps per host (600, so the same samples per
host), each host on its own share (a half; a quarter with 4 hosts) of a fixed training split; the final model is
evaluated on a held-out test split (540 images). Modes:

    ddp              PyTorch DDP, gloo, 2 processes (gradients all-reduced every step)
    fp32             Nodeox, unquantized exchange (--codec fp32)
    q4               Nodeox q4, the coordinator's default outer optimizer
    q4_average       Nodeox q4, --outer-optimizer average
    q4_nesterov      Nodeox q4, --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9 (DiLoCo)
    overlap_eager    q4, NodeoxStrategy(overlap=True)        (overlap_delayed: overlap="delayed")
    uneven           q4, host 1 slowed on purpose to about 2x host 0's step time
    uneven_budget    uneven, with NodeoxStrategy(round_seconds=host 0's time for local_steps steps)
    uneven_budget_overlap  the same with overlap=True
    q4_4hosts        q4 with 4 hosts, each on its quarter of the training split (the relay row's baseline)
    q4_relays        q4_4hosts as 2 sites x 2 hosts: `nodeox launch --sites 2`, a root and 2 relays, hosts 0-1
                     behind one and 2-3 behind the other; each relay re-quantizes its site's mean (a second q4 stage)
    q4_no_ef         q4 with NodeoxStrategy(error_feedback=False): what error feedback buys
    q2               Nodeox, --codec q2 (2-bit, 0.53x q4's bytes at block size 64)
    q2_b256          q2 at --block-size 256 (0.49x q4's bytes)
    sparse_d1        Nodeox, the sparse codec's earlier form (--codec sparse --density 0.01 --chunking runs --levels q2
                     --error-decay 1 --mean deltas: top 1% of each run of 4096 values, q2's levels: 0.035x q4's bytes)
    sparse_d3        the same at --density 0.03 (0.10x q4's bytes)
    sparseloco       Nodeox, --codec sparse --chunking tiles: SparseLoCo's recipe as written, its 64x64 chunks
                     (docs/algorithms.md; 0.053x q4's bytes)
    sparse           Nodeox, --codec sparse: the recipe in runs of 4096 values, the codec's default
    q4_f4            q4 with NodeoxStrategy(fragments=4): a round every local_steps/4 steps exchanges a quarter
    bf16             Nodeox, --codec bf16 (not run by default on digits)
    q4_average_hH, q4_nesterov_hH   q4 average / Nesterov at H local steps, H in 10, 20, 50, 100
                     (--local-steps-sweep runs these and DDP)

The epoch modes (issue 30; not run by default; without other modes, no DDP run either) train 3 hosts for --epochs
passes (default 15) over the whole training split at 5 local steps, logging the indices each step trained, and
print each epoch's samples the published model lost or repeated (benchmarks/epoch_samples.py):

    sharded3         hand-sharded: each host its third of the split, by its id (use_distributed_sampler=False)
    sharded3_faults  sharded3 with faults: host 1 killed with -9 six steps into epoch 1, and a host 3 joining then
                     (--elastic), which by its id trains host 0's third again; the coordinator killed with -9 six
                     steps into host 0's epoch 2 and started again on its run directory (it resumes)
    ledger           the coordinator's data ledger shares out each epoch (Lightning's default sampler, units of 32)
    ledger_faults    ledger with the same faults

The heterogeneous modes (issue 31; not run by default) run 4 hosts, host 1 of them uneven, under each way a round
may take its deltas, ``het_SCENARIO_MERGE``:

    SCENARIO  (every step also sleeps HET_PACE, 50 ms, as a GPU's step would take: the exchange is then small
              beside a round, as on a real cluster) even: all hosts alike (the reference); slow3: host 1 3x slower every step; stall: host 1 stalls
              STALL_SECONDS twice, at steps drawn from the seed in the middle three fifths of its run
    MERGE     sync: today's rounds (every live host); budget: NodeoxStrategy(round_seconds=host 0's time for
              local_steps steps, measured in the het run before; each host's steps in proportion to its speed);
              async_age, async_samples: --merge async --min-quorum 3 with that --staleness-rule

The lm workload runs ddp, fp32, bf16, q4, q4_nesterov, q4_no_ef, q2, q2_b256, sparse_d1, sparse_d3, sparseloco,
sparse, int8, fp8 and q4_f4 by default (--modes takes any).

Every mode runs 2 hosts unless it says otherwise; the 4-host modes' differences and ratios to DDP are to DDP's 2
ranks all the same (their own comparison is to each other: the relay goal).
Modes whose options this version of lightning_nodeox does not have yet are reported as "not available yet".
Printed per mode: test accuracy (mean and min-max over seeds), its difference to DDP in percentage points,
bytes sent per host, wall time, each host's wait share, ratios to DDP; then the goals, MET or MISSED.

    python benchmarks/convergence.py [--workload digits|lm] [--json] [--seeds 3] [--quick] [--modes ddp,q4,...]
                                     [--local-steps-sweep] [--results FILE] [--epochs 15]
                                     [--define-mode JSON] [--without-ddp] [--first-seed S] [--eval-every N]

``--define-mode`` runs a mode given on the command line, ``--eval-every`` records the metric every N steps (host 0's,
as the result's ``curve``): benchmarks/codec_table.py runs its rows through them, one seed a process.

Each seed's run is appended to a JSON-lines file as it ends (``--results``); a run that fails is recorded there
(and in the table) and the next one runs.

Definitions (see `ddp_bytes_per_host`, `nodeox_bytes_sent` and `wait_share` in benchmarks/convergence_metrics.py):
- bytes per host, DDP: steps x gradient bytes x 2(N-1)/N, the bytes one rank sends in a ring all-reduce of every
  parameter's fp32 gradient every step (N = 2 ranks: 1x the gradient bytes per step). The start-up broadcast of
  the model from rank 0 is not counted (nor is Nodeox's first upload of the model, see below).
- bytes per host, Nodeox: the `bytes` of the host's `upload` records in the run's events.jsonl (its deltas), mean
  over hosts. The full model host 0 provides at join is not an `upload` record, hence not counted.
- peak exch: the largest delta a host sent before its last round (mean over hosts), the bytes one exchange puts on
  the link at once; DDP: one step's all-reduce. With fragments the last round exchanges every tensor (its bytes are
  in the JSON as `final_bytes`).
- wait share of a host: the share of its time, from its first `train` start to its last record's end, in which
  its trainer did not train: that time less its `train` records, plus its `fold` records (a fold stops training
  inside a round). From round 1 on (round 0 holds the hosts' different start-up times). Exchange work that runs
  while training goes on (overlap) is not blocked time, whatever its phase. Not measured for DDP.
- wall: the slowest host's `trainer.fit` (start-up of the interpreter, imports and the test evaluation excluded).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import SampleLog, add_results_option
from convergence_host import host_main
from convergence_modes import (BATCH_SIZE, DEFAULT_MODES, EPOCH_MODES, EPOCHS, HET_MODES, HIDDEN, HOSTS, LM_MODES,
                               LM_STEPS, LOCAL_STEPS, LR, MODES, SLOWDOWN, STEPS, SWEEP, SWEEP_MODES, WORKLOADS)
from convergence_report import (bytes_text, epoch_goals, goals, het_goals, lm_goals, print_epochs, print_table,
                                summarize, with_ratios)
from convergence_runs import Unavailable, missing_option, preflight, run_ddp, run_epochs, run_nodeox


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one seed")
    p.add_argument("--workload", default="digits", choices=tuple(WORKLOADS),
                   help="digits (default), or lm: the language model of benchmarks/lm.py")
    p.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (ddp always runs, unless --without-ddp: "
                   f"the ratios are to it; default: {','.join(DEFAULT_MODES)} on digits, {','.join(LM_MODES)} on lm)")
    p.add_argument("--local-steps-sweep", action="store_true",
                   help=f"run q4 average and Nesterov at local steps {', '.join(map(str, SWEEP))} (and DDP) "
                   "instead of --modes")
    p.add_argument("--steps", type=int, help=f"optimizer steps per host (default: digits {STEPS}, lm {LM_STEPS})")
    p.add_argument("--local-steps", type=int, default=LOCAL_STEPS)
    p.add_argument("--batch-size", type=int, help=f"default: digits {BATCH_SIZE}, lm {WORKLOADS['lm'].batch_size}")
    p.add_argument("--lr", type=float, help=f"inner learning rate (default: digits {LR}, lm {WORKLOADS['lm'].lr:g})")
    p.add_argument("--round-seconds", type=float,
                   help="uneven_budget's round_seconds (default: host 0's measured time for local_steps steps)")
    p.add_argument("--epochs", type=int, default=EPOCHS, help=f"the epoch modes' passes (default {EPOCHS})")
    p.add_argument("--keep", type=Path, help="keep every run's directory under this folder")
    p.add_argument("--define-mode", metavar="JSON", help='a mode of your own: {"name": NAME, "coordinator": [FLAGS], '
                   '"strategy": {NodeoxStrategy keyword arguments}, "local_steps": H} (a Nodeox mode; '
                   "benchmarks/codec_table.py's rows), then run by --modes NAME")
    p.add_argument("--without-ddp", action="store_true", help="leave out DDP's run (the ratios to it are then blank)")
    p.add_argument("--first-seed", type=int, default=0, help="the seeds run are FIRST_SEED, FIRST_SEED + 1, ...")
    p.add_argument("--eval-every", type=int, default=0, help="each host also evaluates every N steps (a round's end "
                   "at N = --local-steps); host 0's evaluations are the result's curve (default 0: at the end only)")
    add_results_option(p)
    # the host, started by this script (DDP) or by `nodeox launch`
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--strategy-kwargs", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--slow-host", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--slowdown", type=float, default=SLOWDOWN, help=argparse.SUPPRESS)
    p.add_argument("--stalls", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pace", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--host-steps", help=argparse.SUPPRESS)
    p.add_argument("--num-hosts", type=int, default=HOSTS, help=argparse.SUPPRESS)
    p.add_argument("--host-epochs", type=int, help=argparse.SUPPRESS)  # an epoch mode's host: max_epochs, logged
    p.add_argument("--ledger", action="store_true", help=argparse.SUPPRESS)  # the coordinator shares out the data
    p.add_argument("--join-when", help=argparse.SUPPRESS)  # fit (join the run) once this file exists
    args = p.parse_args()
    if args.host:
        host_main(args)
        return
    workload = WORKLOADS[args.workload]
    metric = workload.metric
    if args.define_mode:
        spec = json.loads(args.define_mode)
        MODES[spec.pop("name")] = {"kind": "nodeox", **spec}
    args.steps = args.steps or workload.steps
    args.batch_size = args.batch_size or workload.batch_size
    args.lr = args.lr or workload.lr
    if args.local_steps_sweep and args.modes:
        p.error("--local-steps-sweep runs its own modes; leave out --modes")
    modes_text = ",".join(SWEEP_MODES) if args.local_steps_sweep else args.modes or ",".join(workload.modes)
    wanted = [m.strip() for m in modes_text.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in MODES]
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    # ddp first (the ratios are to it), unless left out, or every mode asked for is an epoch mode or a heterogeneous
    # one (compared with each other)
    alone = set(wanted) <= set(EPOCH_MODES) or set(wanted) <= set(HET_MODES)
    baseline = not alone and (not args.without_ddp or "ddp" in wanted)
    order = (["ddp"] if baseline else []) + [m for m in MODES if m in wanted and m != "ddp"]
    seeds = list(range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds)))

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    launch_help, strategy_params = preflight()
    log = SampleLog("convergence", args.results)
    modes: dict[str, dict] = {}
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="nodeox-convergence-")
    root = args.keep or Path(tmp.name)
    try:
        for mode in order:
            missing = missing_option(mode, launch_help, strategy_params)
            if missing:
                modes[mode] = {"status": "not available yet", "reason": f"{missing} not in this lightning_nodeox"}
                say(f"{mode}: not available yet ({missing})")
                continue
            round_seconds = None
            if MODES[mode].get("strategy", {}).get("round_seconds") == "auto":
                round_seconds = args.round_seconds or _round_seconds(modes, args.local_steps)
                if round_seconds is None:
                    say(f"{mode}: measuring host 0's step time with a q4 run first")
                    calib = run_nodeox(args, "q4", 0, root / f"calibrate-{time.time_ns()}", None)
                    round_seconds = calib["step_s"]["0"] * args.local_steps
            runs, errors, entry = [], [], {"status": "ok"}
            for seed in seeds:
                workdir = root / f"{mode}-seed{seed}"
                if workdir.exists():
                    workdir = root / f"{mode}-seed{seed}-{time.time_ns()}"
                say(f"{mode} seed {seed} ...")
                try:
                    with log.sample({"mode": mode, "seed": seed}, unless=(Unavailable,)) as taken:
                        kind = MODES[mode]["kind"]
                        taken.result = (run_ddp(args, seed, workdir) if kind == "ddp"
                                        else run_epochs(args, mode, seed, workdir) if kind == "epochs"
                                        else run_nodeox(args, mode, seed, workdir, round_seconds))
                        if metric.key not in taken.result:
                            raise KeyError(f"the hosts' results have no {metric.key}")
                except Unavailable as e:
                    entry = {"status": "not available yet", "reason": str(e)}
                    say(f"{mode}: not available yet ({e})")
                    break
                if taken.failed:
                    errors.append(f"seed {seed}: {taken.failed}")
                    continue
                r = taken.result
                r["seed"] = seed
                runs.append(r)
                say(f"{mode} seed {seed}: {metric.label} {r[metric.key]:.4f}, bytes/host "
                    f"{bytes_text(r['bytes_per_host'])}, wall {r['wall_s']:.1f}s, wait {r['wait_share']}")
            if runs:
                entry.update(runs=runs, summary=summarize(runs, metric))
                if round_seconds is not None:
                    entry["round_seconds"] = round_seconds
            elif entry["status"] == "ok":
                entry = {"status": "failed", "reason": errors[0] if errors else "no run"}
            if errors:
                entry["errors"] = errors
            modes[mode] = entry
    finally:
        if tmp is not None:
            tmp.cleanup()
    with_ratios(modes, metric)

    def first(key: str):
        return next((m["runs"][0][key] for m in modes.values() if m.get("runs") and key in m["runs"][0]), None)

    config = {"workload": args.workload, "hosts": HOSTS, "steps": args.steps, "local_steps": args.local_steps,
              "batch_size": args.batch_size, "lr": args.lr, "slowdown": SLOWDOWN, "seeds": len(seeds),
              "epochs": args.epochs,
              **({"val_tokens": first("val_tokens")} if args.workload == "lm"
                 else {"hidden": HIDDEN, "test_samples": first("test_samples")})}
    if set(wanted) <= set(HET_MODES) | {"ddp"}:
        result_goals = het_goals(modes, metric)
    elif args.workload == "lm":
        result_goals = lm_goals(modes)
    elif set(wanted) <= set(EPOCH_MODES):
        result_goals = epoch_goals(modes)
    else:
        result_goals = goals(modes, args.local_steps) + epoch_goals(modes)
    if args.json:
        print(json.dumps({"config": config, "modes": modes, "goals": result_goals}, indent=2))
        return
    print_table(modes, config, metric)
    print_epochs(modes, args.epochs)
    print("\ngoals:")
    for g in result_goals:
        status = "NOT RUN" if g["met"] is None else "MET" if g["met"] else "MISSED"
        print(f"  {status:7} {g['goal']}: {g['measured']}")


def _round_seconds(modes: dict, local_steps: int) -> float | None:
    """Host 0's median time for ``local_steps`` steps in the Nodeox runs so far (host 0 is never slowed)."""
    per_step = [r["step_s"]["0"] for m in modes.values() for r in m.get("runs", [])
                if r.get("step_s", {}).get("0") is not None]
    return statistics.median(per_step) * local_steps if per_step else None


if __name__ == "__main__":
    main()
