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

Definitions (see `ddp_bytes_per_host`, `nodeox_bytes_sent` and `wait_share`):
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
from convergence_host import host_main, split_size
from convergence_modes import (ACCURACY, BATCH_SIZE, DATA_UNIT, EPOCH_HOSTS, EPOCH_LOCAL_STEPS, EPOCH_MODES, EPOCHS,
                               HET_MODES, HIDDEN, HOSTS, KILL_AFTER, LM_STEPS, LOCAL_STEPS, LR, MODES, RELAY_BASELINE,
                               RELAY_MODE, RESTART_EPOCH, SLOWDOWN, STEPS, SWEEP, SWEEP_MODES, WORKLOADS, Metric)
from convergence_runs import Unavailable, missing_option, preflight, run_ddp, run_epochs, run_nodeox

GOAL_ACC_POINTS = 1.0
GOAL_BYTES_RATIO = 100.0
GOAL_OVERLAP_WAIT = 0.05
GOAL_BUDGET_FAST_WAIT = 0.10
WAIT_COLUMNS = ("0", "1", "2", "3")  # the hosts whose wait share the table shows
GOAL_ASYNC_WALL = 0.6  # async's wall time over sync's, slow3 and stall
GOAL_ASYNC_FAST_WAIT = 0.02  # the fast hosts' wait share under async


def summarize(runs: list[dict], metric: Metric = ACCURACY) -> dict:
    values = [r[metric.key] for r in runs]
    key = metric.key
    hosts = sorted(runs[0]["wait_share"])
    waits = {h: [r["wait_share"][h] for r in runs if r["wait_share"].get(h) is not None] for h in hosts}
    extra = {"perplexity_mean": statistics.mean(r["perplexity"] for r in runs)} if "perplexity" in runs[0] else {}
    if "epochs" in runs[0]:  # an epoch mode: samples lost and repeated per epoch, mean and max over seeds
        extra["epochs"] = [{"epoch": e, **{f"{k}_{f.__name__}": f(r["epochs"][e][k] for r in runs)
                                           for k in ("lost", "repeated") for f in (statistics.mean, max)}}
                           for e in range(len(runs[0]["epochs"]))]
    return {
        "seeds": len(runs), f"{key}_mean": statistics.mean(values), f"{key}_min": min(values),
        f"{key}_max": max(values), f"{key}_stdev": statistics.stdev(values) if len(values) > 1 else 0.0, **extra,
        "bytes_per_host": statistics.mean(r["bytes_per_host"] for r in runs),
        **{k: statistics.mean(r[k] for r in runs) for k in ("peak_bytes", "final_bytes") if k in runs[0]},
        "wall_s": statistics.mean(r["wall_s"] for r in runs),
        "wait_share": {h: statistics.mean(w) if w else None for h, w in waits.items()},
        **({"wait_share_steady": {h: statistics.mean(r["wait_share_steady"][h] or 0.0 for r in runs) for h in hosts}}
           if "wait_share_steady" in runs[0] else {}),
        "hosts_identical": all(r["hosts_identical"] for r in runs),
        "samples": {h: statistics.mean(r["samples"][h] for r in runs) for h in hosts},
        "step_s": {h: statistics.mean(v) if v else None
                   for h in hosts for v in [[r["step_s"][h] for r in runs if r["step_s"].get(h) is not None]]},
    }


def with_ratios(modes: dict, metric: Metric = ACCURACY) -> None:
    ddp = modes.get("ddp", {}).get("summary")
    for m in modes.values():
        s = m.get("summary")
        if not s or not ddp:
            continue
        s[metric.vs_ddp] = metric.scale * (s[f"{metric.key}_mean"] - ddp[f"{metric.key}_mean"])
        s["bytes_ratio_ddp_to_mode"] = ddp["bytes_per_host"] / s["bytes_per_host"] if s["bytes_per_host"] else None
        s["wall_ratio_to_ddp"] = s["wall_s"] / ddp["wall_s"]


def goals(modes: dict, local_steps: int) -> list[dict]:
    def summary(mode: str) -> tuple[dict | None, str]:
        m = modes.get(mode)
        if m is None:
            return None, "not run (not in --modes)"
        if "summary" not in m or "accuracy_vs_ddp_points" not in m["summary"]:
            return None, m.get("reason", "no result")
        return m["summary"], ""

    def close(s: dict) -> bool:
        return s["accuracy_vs_ddp_points"] >= -GOAL_ACC_POINTS

    out = []
    s, why = summary("q4")
    goal = (f"q4, default outer optimizer, {local_steps} local steps: accuracy within {GOAL_ACC_POINTS:g} point of DDP "
            f"and >= {GOAL_BYTES_RATIO:g}x fewer bytes per host")
    if s:
        ratio = s["bytes_ratio_ddp_to_mode"] or 0.0
        out.append({"goal": goal, "met": close(s) and ratio >= GOAL_BYTES_RATIO,
                    "measured": f"{s['accuracy_vs_ddp_points']:+.2f} points, {ratio:.0f}x fewer bytes"})
    else:
        out.append({"goal": goal, "met": None, "measured": why})
    for mode in ("overlap_eager", "overlap_delayed"):
        s, why = summary(mode)
        goal = (f"{mode}: every host's wait share < {GOAL_OVERLAP_WAIT:.0%}, accuracy within {GOAL_ACC_POINTS:g} "
                f"point of DDP")
        if s:
            worst = max((w for w in s["wait_share"].values() if w is not None), default=float("nan"))
            out.append({"goal": goal, "met": close(s) and worst < GOAL_OVERLAP_WAIT,
                        "measured": f"{s['accuracy_vs_ddp_points']:+.2f} points, worst wait share {worst:.1%}"})
        elif mode == "overlap_eager" or mode in modes:
            out.append({"goal": goal, "met": None, "measured": why})
    for mode in ("uneven_budget", "uneven_budget_overlap"):
        s, why = summary(mode)
        goal = (f"{mode}: uneven hosts (one {SLOWDOWN:g}x slower) with the time budget: fast host's wait share < "
                f"{GOAL_BUDGET_FAST_WAIT:.0%}, accuracy within {GOAL_ACC_POINTS:g} point of DDP")
        if s:
            fast = s["wait_share"].get("0")
            out.append({"goal": goal, "met": close(s) and fast is not None and fast < GOAL_BUDGET_FAST_WAIT,
                        "measured": f"{s['accuracy_vs_ddp_points']:+.2f} points, fast host wait share "
                                    f"{'n/a' if fast is None else f'{fast:.1%}'}"})
        elif mode in modes:
            out.append({"goal": goal, "met": None, "measured": why})
    if RELAY_MODE in modes or RELAY_BASELINE in modes:
        out.append(relay_goal(modes))
    return out


def relay_goal(modes: dict) -> dict:
    """The relay row against flat 4 hosts: the accuracy the relays' second quantization stage costs (baseline mean
    less relay mean) is at most the baseline's seed spread (its max less its min), and every host ends on one model."""
    goal = (f"{RELAY_MODE} (2 sites x 2 hosts, each relay re-quantizes its site's mean): accuracy below "
            f"{RELAY_BASELINE}'s (flat 4 hosts) by no more than {RELAY_BASELINE}'s seed spread (max - min)")
    found = []
    for mode in (RELAY_MODE, RELAY_BASELINE):
        m = modes.get(mode)
        if m is None or "summary" not in m:
            why = "not run (not in --modes)" if m is None else m.get("reason", "no result")
            return {"goal": goal, "met": None, "measured": f"{mode}: {why}"}
        found.append(m["summary"])
    relay, base = found
    cost = 100 * (base["accuracy_mean"] - relay["accuracy_mean"])
    spread = 100 * (base["accuracy_max"] - base["accuracy_min"])
    return {"goal": goal, "met": cost <= spread and relay["hosts_identical"],
            "measured": f"{100 * relay['accuracy_mean']:.2f}% against {100 * base['accuracy_mean']:.2f}%: "
                        f"{cost:+.2f} points lost, spread {spread:.2f} points over {base['seeds']} seed(s)"
                        + ("" if relay["hosts_identical"] else "; relay hosts ended on different models")}


def lm_goals(modes: dict) -> list[dict]:
    """The language model's goals: a codec at half q4's bytes or fewer whose validation loss is within q4's seed
    spread (its mean at most q4's mean plus q4's max less min), on one model across hosts; and q4 without error
    feedback measured against q4 with (what error feedback buys: met once both ran)."""
    base = modes.get("q4", {}).get("summary")
    out = []
    for mode in ("q2", "q2_b256", "sparse_d1", "sparse_d3", "sparseloco", "sparse"):
        goal = (f"{mode}: at most 0.5x q4's bytes per host, validation loss within q4's seed spread "
                f"(mean <= q4's mean + (max - min))")
        s = modes.get(mode, {}).get("summary")
        if s is None or base is None:
            if mode in modes:
                why = next((f"{m}: {modes[m].get('reason', 'no result')}" if m in modes else f"{m}: not run"
                            for m in (mode, "q4") if modes.get(m, {}).get("summary") is None), "")
                out.append({"goal": goal, "met": None, "measured": why})
            continue
        ratio = s["bytes_per_host"] / base["bytes_per_host"]
        spread, excess = _against(s, base)
        out.append({"goal": goal, "met": ratio <= 0.5 and excess <= spread and s["hosts_identical"],
                    "measured": f"{ratio:.3f}x q4's bytes, val loss {s['val_loss_mean']:.4f} against q4's "
                                f"{base['val_loss_mean']:.4f} ({excess:+.4f}, spread {spread:.4f} over "
                                f"{base['seeds']} seed(s))"})
    s = modes.get("q4_f4", {}).get("summary")
    goal = ("q4_f4: peak bytes per exchange (before the final round) at most 0.3x q4's, validation loss within q4's "
            "seed spread")
    if s is not None and base is not None:
        ratio = s["peak_bytes"] / base["peak_bytes"]
        spread, excess = _against(s, base)
        out.append({"goal": goal, "met": ratio <= 0.3 and excess <= spread and s["hosts_identical"],
                    "measured": f"{ratio:.3f}x q4's peak ({_bytes(s['peak_bytes'])}; the final round, every tensor: "
                                f"{_bytes(s['final_bytes'])}), val loss {s['val_loss_mean']:.4f} against "
                                f"{base['val_loss_mean']:.4f} ({excess:+.4f}, spread {spread:.4f})"})
    elif "q4_f4" in modes:
        out.append({"goal": goal, "met": None, "measured": modes["q4_f4"].get("reason", "no result")})
    s = modes.get("q4_no_ef", {}).get("summary")
    goal = "q4_no_ef: q4 without error feedback measured against q4 with"
    if s is not None and base is not None:
        out.append({"goal": goal, "met": True,
                    "measured": f"val loss {s['val_loss_mean']:.4f} against {base['val_loss_mean']:.4f} with error "
                                f"feedback ({s['val_loss_mean'] - base['val_loss_mean']:+.4f})"})
    elif "q4_no_ef" in modes:
        out.append({"goal": goal, "met": None, "measured": modes["q4_no_ef"].get("reason", "no result")})
    return out


def _against(s: dict, base: dict) -> tuple[float, float]:
    """The seed spread of ``base``'s validation loss (max less min), and how far ``s``'s mean lies above its mean."""
    return base["val_loss_max"] - base["val_loss_min"], s["val_loss_mean"] - base["val_loss_mean"]


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def print_table(modes: dict, config: dict, metric: Metric = ACCURACY) -> None:
    if config.get("workload", "digits") == "lm":
        print(f"\nconvergence on the language model (benchmarks/lm.py): {config['hosts']} hosts, {config['steps']} "
              f"steps x batch {config['batch_size']} x 128 bytes per host, local_steps={config['local_steps']} "
              f"(unless the mode says), AdamW lr {config['lr']}, validation {config['val_tokens']} bytes, "
              f"seeds {config['seeds']}; val loss in nats per byte (lower is better)")
    elif all(MODES[name]["kind"] == "epochs" for name in modes):
        print(f"\nconvergence on digits, the epoch modes (below): {config['epochs']} epochs, seeds {config['seeds']}")
    else:
        print(f"\nconvergence on digits: {config['hosts']} hosts (unless the hosts column says), {config['steps']} "
              f"steps x batch {config['batch_size']} "
              f"per host, local_steps={config['local_steps']}, SGD lr {config['lr']} momentum 0.9, test set "
              f"{config['test_samples']} images, seeds {config['seeds']}")
    head = (f"{'mode':16} {'hosts':>5} {metric.label + ' mean (min-max)':26} {'vs DDP':>8} {'bytes/host':>11} "
            f"{'peak exch':>10} "
            f"{'DDP/mode':>9} {'wall s':>7} {'vs DDP':>7} " + " ".join(f"{f'wait h{h}':>8}" for h in WAIT_COLUMNS))
    print(head)
    print("-" * len(head))
    for name, m in modes.items():
        s = m.get("summary")
        if not s:
            print(f"{name:16} {m['status']}: {m.get('reason', '')}")
            continue
        mean, low, high = (s[f"{metric.key}_{part}"] for part in ("mean", "min", "max"))
        acc = (f"{100 * mean:.2f}% ({100 * low:.2f}-{100 * high:.2f})" if metric.unit == "pt"
               else f"{mean:.4f} ({low:.4f}-{high:.4f})")
        dp = s.get(metric.vs_ddp)
        br = s.get("bytes_ratio_ddp_to_mode")
        wr = s.get("wall_ratio_to_ddp")
        waits = [s["wait_share"].get(h) for h in WAIT_COLUMNS]
        spec = MODES[name]
        shape = f"{spec.get('sites', 1)}x{spec.get('hosts', HOSTS) // spec.get('sites', 1)}" if spec.get("sites") \
            else str(spec.get("hosts", HOSTS))
        diff = "-" if dp is None else f"{dp:+.2f} pt" if metric.unit == "pt" else f"{dp:+.4f}"
        print(f"{name:16} {shape:>5} {acc:26} {diff:>8} "
              f"{_bytes(s['bytes_per_host']):>11} {_bytes(s.get('peak_bytes')):>10} "
              f"{'-' if br is None else f'{br:.1f}x':>9} {s['wall_s']:7.1f} {'-' if wr is None else f'{wr:.2f}x':>7} "
              + " ".join(f"{'-' if w is None else f'{w:.1%}':>8}" for w in waits)
              + (f"  perplexity {s['perplexity_mean']:.3f}" if "perplexity_mean" in s else "")
              + ("" if s["hosts_identical"] else "  (hosts ended on different models!)"))
        steps = s["step_s"]
        if MODES[name].get("slow") and steps.get("0") and steps.get("1"):
            budget = m.get("round_seconds")
            print(f"{'':16} host 1's step took {steps['1'] / steps['0']:.2f}x host 0's ({1000 * steps['0']:.1f} ms); "
                  f"samples trained: host 0 {s['samples']['0']:.0f}, host 1 {s['samples']['1']:.0f}"
                  + ("" if budget is None else f"; round_seconds {budget:.2f}"))
        if "wait_share_steady" in s:
            print(f"{'':16} wait share before the final round (which waits for every host): "
                  + ", ".join(f"h{h} {w:.1%}" for h, w in s["wait_share_steady"].items()))
        if m.get("errors"):
            print(f"{'':16} {len(m['errors'])} seed(s) failed: {m['errors'][0]}")


def epoch_goals(modes: dict) -> list[dict]:
    """Issue 30's: the ledger runs' accuracy within the seed spread of the fault-free hand-sharded run (their mean at
    least its mean less its max - min), with no sample of any epoch lost or repeated; the hand-sharded run with
    faults: what it lost."""
    base = modes.get("sharded3", {}).get("summary")
    out = []
    for mode in ("ledger", "ledger_faults"):
        if mode not in modes:
            continue
        s = modes[mode].get("summary")
        goal = (f"{mode}: accuracy within sharded3's seed spread (mean >= its mean - (max - min)), no sample of any "
                "epoch lost or repeated")
        if s is None or base is None:
            why = modes[mode].get("reason") if s is None else "sharded3: not run"
            out.append({"goal": goal, "met": None, "measured": why or "no result"})
            continue
        spread = base["accuracy_max"] - base["accuracy_min"]
        short = base["accuracy_mean"] - s["accuracy_mean"]
        off = sum(e["lost_max"] + e["repeated_max"] for e in s["epochs"])
        out.append({"goal": goal, "met": short <= spread and off == 0,
                    "measured": f"{100 * s['accuracy_mean']:.2f}% against {100 * base['accuracy_mean']:.2f}% "
                                f"({-100 * short:+.2f} points, spread {100 * spread:.2f}); {off} samples lost or "
                                "repeated (each epoch's worst seed, summed)"})
    s = modes.get("sharded3_faults", {}).get("summary")
    if s is not None:
        lost, repeated = (sum(e[f"{k}_mean"] for e in s["epochs"]) for k in ("lost", "repeated"))
        out.append({"goal": "sharded3_faults: what hand-sharding loses to the same faults", "met": True,
                    "measured": f"{lost:.0f} samples lost and {repeated:.0f} repeated over {len(s['epochs'])} epochs "
                                f"(mean over seeds); accuracy {100 * s['accuracy_mean']:.2f}%"})
    return out


def print_epochs(modes: dict, epochs: int) -> None:
    """The epoch modes' samples lost and repeated per epoch (mean over seeds, max in brackets when it differs)."""
    shown = {name: m["summary"] for name, m in modes.items() if m.get("summary", {}).get("epochs")}
    if not shown:
        return
    print(f"\nepoch modes: {EPOCH_HOSTS} hosts, {epochs} epochs over the training split ({split_size()} samples), "
          f"shared by hand (sharded3: each host a third, by its id) or by the data ledger (units of {DATA_UNIT}); "
          f"local_steps={EPOCH_LOCAL_STEPS}; faults: host 1 killed with -9 after {KILL_AFTER} steps of epoch 1, "
          f"host {EPOCH_HOSTS} joining then (--elastic); the coordinator killed with -9 after host 0's "
          f"{KILL_AFTER} steps of epoch {RESTART_EPOCH}, and started again.\nSamples of each epoch the published model lost / repeated, "
          "mean over seeds (max):")
    head = f"{'epoch':>5} " + " ".join(f"{name:>22}" for name in shown)
    print(head)
    print("-" * len(head))

    def cell(row: dict, k: str) -> str:
        mean, top = row[f"{k}_mean"], row[f"{k}_max"]
        return f"{mean:.0f}" + ("" if top == mean else f" ({top})")

    for e in range(epochs):
        print(f"{e:>5} " + " ".join(f"{cell(s['epochs'][e], 'lost') + ' / ' + cell(s['epochs'][e], 'repeated'):>22}"
                                    for s in shown.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one seed")
    p.add_argument("--workload", default="digits", choices=tuple(WORKLOADS),
                   help="digits (default), or lm: the language model of benchmarks/lm.py")
    p.add_argument("--modes", help=f"comma-separated, of {','.join(MODES)} (ddp always runs, unless --without-ddp: "
                   "the ratios are to it; default: {','.join(DEFAULT_MODES)} on digits, {','.join(LM_MODES)} on lm)")
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
                say(f"{mode} seed {seed}: {metric.label} {r[metric.key]:.4f}, bytes/host {_bytes(r['bytes_per_host'])}, "
                    f"wall {r['wall_s']:.1f}s, wait {r['wait_share']}")
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


def het_goals(modes: dict, metric: Metric) -> list[dict]:
    """Issue 31's goals: under ``--merge async``, slow3 and stall: wall time at most ``GOAL_ASYNC_WALL`` of sync's,
    the fast hosts' wait under ``GOAL_ASYNC_FAST_WAIT``; in every scenario the metric within the seed spread of
    het_even_sync (or better)."""
    def summary(mode: str) -> dict | None:
        return modes.get(mode, {}).get("summary")

    even = summary("het_even_sync")
    lower_better = metric.key == "val_loss"
    out = []
    for mode in [m for m in HET_MODES if "async" in m and summary(m)]:
        s = summary(mode)
        scenario = mode.split("_")[1]
        if scenario != "even" and summary(f"het_{scenario}_sync"):
            ratio = s["wall_s"] / summary(f"het_{scenario}_sync")["wall_s"]
            fast = max(s["wait_share_steady"][h] for h in ("0", "2", "3"))
            whole = max(s["wait_share"][h] or 0.0 for h in ("0", "2", "3"))
            out.append({"goal": f"{mode}: wall <= {GOAL_ASYNC_WALL}x het_{scenario}_sync's, fast hosts' wait < "
                                f"{GOAL_ASYNC_FAST_WAIT:.0%} (before the final round, which waits for every host)",
                        "met": ratio <= GOAL_ASYNC_WALL and fast < GOAL_ASYNC_FAST_WAIT,
                        "measured": f"wall {ratio:.2f}x, fast hosts' wait up to {fast:.1%} ({whole:.1%} with the "
                                    "final round)"})
        if even:
            mean, bound = s[f"{metric.key}_mean"], even[f"{metric.key}_{'max' if lower_better else 'min'}"]
            met = mean <= bound if lower_better else mean >= bound
            out.append({"goal": f"{mode}: {metric.label} within het_even_sync's seed spread or better",
                        "met": met, "measured": f"{mean:.4f} against het_even_sync's "
                                                f"{even[f'{metric.key}_min']:.4f}-{even[f'{metric.key}_max']:.4f}"})
    return out


def _round_seconds(modes: dict, local_steps: int) -> float | None:
    """Host 0's median time for ``local_steps`` steps in the Nodeox runs so far (host 0 is never slowed)."""
    per_step = [r["step_s"]["0"] for m in modes.values() for r in m.get("runs", [])
                if r.get("step_s", {}).get("0") is not None]
    return statistics.median(per_step) * local_steps if per_step else None


if __name__ == "__main__":
    main()
