"""The chaos soak: a long run on digits with faults drawn at random from a seed, checked for anything lost.

    python benchmarks/soak.py [--rounds 100] [--seed 1] [--baseline-seeds 0,1,2] [--run-dir DIR]

4 hosts behind 2 relays (2 per relay) and 2 hosts direct to the root coordinator (benchmarks/soak_host.py: the
test hosts' MLP on scikit-learn's digits, one CPU thread per process, a fixed pace per step), faults from
benchmarks/soak_schedule.py started at the rounds the root reports: host kill -9 and restart with its id, host
SIGSTOP past its lease, root kill -9 and restart on its run directory, relay kill -9 and restart, a link (a relay's
or a direct host's, through benchmarks/soak_proxy.py) down past the lease, the root's disk (a tmpfs) full, and
several at once.

At the end it prints, beside their goals: faults by kind; rounds published, lost and redone (goal 0, from the
root's records and the hosts' ledgers); every host's final model against the root's last published one (bit for
bit: hashes); goodput (goal >= 90%: the share of the hosts' training time that reached the published model,
benchmarks/soak_goodput.py) and its loss by fault kind; the held-out accuracy against uninterrupted runs of the
same cluster with the training seed (the soak's: 0) and others (the seed spread; goal: within it).
Results go to --results (JSON lines) as they come, so that a crash keeps what was measured. Exits 1 when a
correctness check fails (bit-identity, lost or redone rounds).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from soak_cluster import Settings, Topology
from soak_run import run
from soak_schedule import KINDS, draw

GOODPUT_GOAL = 0.90


def spread(baselines: list[dict]) -> dict:
    accs = [b["accuracy"] for b in baselines if b.get("accuracy") is not None]
    return {"accuracies": accs, "min": min(accs, default=None), "max": max(accs, default=None)}


def render(soak: dict, baselines: list[dict], args: argparse.Namespace, faults: int) -> str:
    r, sp, acc = soak["rounds"], spread(baselines), soak["accuracy"]
    within = sp["min"] is not None and acc is not None and sp["min"] <= acc <= sp["max"]
    lines = [f"chaos soak: seed {args.seed}, {args.relays} relays x {args.hosts_per_relay} hosts + {args.direct} "
             f"direct, lease {args.lease:g} s, {args.local_steps} local steps of {args.step_seconds:g} s, "
             f"{soak['wall_s']:.0f} s",
             f"  faults drawn {faults}, injected by kind: " + ", ".join(f"{k} {v}" for k, v in
                                                                          sorted(soak["faults"].items())),
             f"    begun while another was under way: {soak['overlapping']}",
             *(f"    skipped: {s}" for s in soak["faults_skipped"]),
             f"  rounds published {r['published']} (0-{r['last']}); lost {len(r['lost'])}, redone {len(r['redone'])}"
             f" (goal 0, 0); republished with the same model {len(r['republished'])}",
             f"  rounds missing from the root's records but taken by hosts: {r['unrecorded']}; taken with the model "
             f"of another round (a fetched model keeps the round waited on): {r['relabelled']}",
             f"  every host bit-identical with the root's final model {soak['final_hash']}: {soak['identical']}",
             f"  goodput {soak['goodput']:.1%} (goal >= {GOODPUT_GOAL:.0%}) of {soak['train_s']:.0f} host-s "
             f"of training; lost by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in soak["lost_share"].items()),
             f"  held-out accuracy {'none' if acc is None else f'{acc:.4f}'}; uninterrupted runs (training seeds "
             f"{args.baseline_seeds}): " + ", ".join(f"{a:.4f}" for a in sp["accuracies"])
             + (f", spread {sp['min']:.4f}-{sp['max']:.4f}: {'within' if within else 'OUTSIDE'} (goal within)"
                if sp["min"] is not None else ""),
             "  uninterrupted goodput: " + ", ".join(f"{b['goodput']:.1%}" for b in baselines)]
    lines += [f"  FAILED: {p}" for p in soak["problems"]] or ["  correctness checks: all passed"]
    return "\n".join(lines)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped soak still stops its cluster and unmounts
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--seed", type=int, default=1, help="the fault schedule's seed")
    p.add_argument("--baseline-seeds", default="0,1,2", help="training seeds of the uninterrupted runs ('' none)")
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--hosts-per-relay", type=int, default=2)
    p.add_argument("--direct", type=int, default=2)
    p.add_argument("--lease", type=float, default=3.0)
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--every", default="4,8", help="rounds between faults: drawn between A and B")
    p.add_argument("--kinds", default=",".join(KINDS), help="the kinds of fault drawn (default: all)")
    p.add_argument("--run-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--results", type=Path, default=Path("soak-results.jsonl"))
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds each run may take")
    args = p.parse_args()
    topology = Topology(args.relays, args.hosts_per_relay, args.direct)
    every = tuple(int(x) for x in args.every.split(","))
    faults = draw(args.seed, args.rounds, topology, args.lease, tuple(args.kinds.split(",")), every=every)
    results = open(args.results, "a", buffering=1)  # noqa: SIM115

    def write(d: dict) -> None:
        results.write(json.dumps({"at": time.time(), **d}) + "\n")

    workdir = args.run_dir or Path(tempfile.mkdtemp(prefix="nodeox-soak-"))
    write({"soak": vars(args) | {"run_dir": str(workdir), "results": str(args.results)},
           "schedule": [f.as_dict() for f in faults]})
    settings = Settings(lease=args.lease, local_steps=args.local_steps, step_seconds=args.step_seconds)
    soak = run(workdir / "soak", topology, settings, faults, args.rounds, [sys.executable], write, args.timeout)
    write({"result": "soak", **soak})
    baselines = []
    for seed in [int(s) for s in args.baseline_seeds.split(",") if s]:
        base = run(workdir / f"baseline-{seed}", topology, Settings(**{**vars(settings), "seed": seed}), [],
                   args.rounds, [sys.executable], write, args.timeout)
        write({"result": f"baseline-{seed}", **base})
        baselines.append(base)
    text = render(soak, baselines, args, len(faults))
    write({"rendered": text})
    print(text)
    sys.exit(1 if soak["problems"] else 0)


if __name__ == "__main__":
    main()
