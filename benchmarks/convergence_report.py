"""What benchmarks/convergence.py reports from its runs: each mode's summary over seeds and its ratios to DDP, the
goals (each MET, MISSED or NOT RUN, with what was measured) of the digits modes, the relay row, the language model,
the epoch modes and the heterogeneous modes, and the printed tables."""

from __future__ import annotations

import statistics

from convergence_host import split_size
from convergence_modes import (ACCURACY, DATA_UNIT, EPOCH_HOSTS, EPOCH_LOCAL_STEPS, HET_MODES, HOSTS, KILL_AFTER, MODES,
                               RELAY_BASELINE, RELAY_MODE, RESTART_EPOCH, SLOWDOWN, Metric)

GOAL_ACC_POINTS = 1.0
GOAL_BYTES_RATIO = 100.0
GOAL_OVERLAP_WAIT = 0.05
GOAL_BUDGET_FAST_WAIT = 0.10
WAIT_COLUMNS = ("0", "1", "2", "3")  # the hosts whose wait share the table shows
GOAL_ASYNC_WALL = 0.6  # async's wall time over sync's, slow3 and stall
GOAL_ASYNC_FAST_WAIT = 0.02  # the fast hosts' wait share under async


def summarize(runs: list[dict], metric: Metric = ACCURACY) -> dict:
    """One mode's runs over its seeds: the metric's mean, min, max and stdev; the means of bytes per host, wall time,
    each host's wait share, samples and step time; an epoch mode's samples lost and repeated per epoch (mean, max)."""
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
    """Each mode's summary gets its metric's difference to DDP's and its bytes and wall-time ratios to DDP (in
    place; nothing without a DDP summary)."""
    ddp = modes.get("ddp", {}).get("summary")
    for m in modes.values():
        s = m.get("summary")
        if not s or not ddp:
            continue
        s[metric.vs_ddp] = metric.scale * (s[f"{metric.key}_mean"] - ddp[f"{metric.key}_mean"])
        s["bytes_ratio_ddp_to_mode"] = ddp["bytes_per_host"] / s["bytes_per_host"] if s["bytes_per_host"] else None
        s["wall_ratio_to_ddp"] = s["wall_s"] / ddp["wall_s"]


def goals(modes: dict, local_steps: int) -> list[dict]:
    """The digits modes' goals: q4's accuracy and bytes against DDP, the overlap modes' wait share, the uneven hosts'
    with a time budget, and the relay row's (`relay_goal`); q4's and overlap_eager's are listed NOT RUN when left out,
    the others only where their mode was asked for."""
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
                    "measured": f"{ratio:.3f}x q4's peak ({bytes_text(s['peak_bytes'])}; the final round, every "
                                f"tensor: {bytes_text(s['final_bytes'])}), val loss {s['val_loss_mean']:.4f} against "
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


def bytes_text(n: float | None) -> str:
    """``n`` bytes in B, kB, MB or GB (of 1000), "-" when unknown."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def print_table(modes: dict, config: dict, metric: Metric = ACCURACY) -> None:
    """Every mode's row: hosts, the metric over seeds and its difference to DDP, bytes per host, peak exchange, wall
    time and the ratios to DDP, each host's wait share; under a slowed mode its hosts' step times and samples."""
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
              f"{bytes_text(s['bytes_per_host']):>11} {bytes_text(s.get('peak_bytes')):>10} "
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


def print_epochs(modes: dict, epochs: int) -> None:
    """The epoch modes' samples lost and repeated per epoch (mean over seeds, max in brackets when it differs)."""
    shown = {name: m["summary"] for name, m in modes.items() if m.get("summary", {}).get("epochs")}
    if not shown:
        return
    print(f"\nepoch modes: {EPOCH_HOSTS} hosts, {epochs} epochs over the training split ({split_size()} samples), "
          f"shared by hand (sharded3: each host a third, by its id) or by the data ledger (units of {DATA_UNIT}); "
          f"local_steps={EPOCH_LOCAL_STEPS}; faults: host 1 killed with -9 after {KILL_AFTER} steps of epoch 1, "
          f"host {EPOCH_HOSTS} joining then (--elastic); the coordinator killed with -9 after host 0's "
          f"{KILL_AFTER} steps of epoch {RESTART_EPOCH}, and started again.\nSamples of each epoch the published model "
          "lost / repeated, mean over seeds (max):")
    head = f"{'epoch':>5} " + " ".join(f"{name:>22}" for name in shown)
    print(head)
    print("-" * len(head))

    def cell(row: dict, k: str) -> str:
        mean, top = row[f"{k}_mean"], row[f"{k}_max"]
        return f"{mean:.0f}" + ("" if top == mean else f" ({top})")

    for e in range(epochs):
        print(f"{e:>5} " + " ".join(f"{cell(s['epochs'][e], 'lost') + ' / ' + cell(s['epochs'][e], 'repeated'):>22}"
                                    for s in shown.values()))
