"""The exchange alone, at ViT-B/16 and ViT-H/14 parameter counts: a coordinator and 2 hosts on this machine.

Hosts hold a synthetic model with the real models' tensor shapes (timm, built on the meta device) and do no
training compute: each round they nudge every tensor and run a real exchange (encode, upload, wait,
download, apply, verify) through `nodeox launch`. Printed per phase: the median over rounds (the first
round, which pays for first-touch allocations, is left out) of the slowest host; aggregation-to-sync
(aggregate end to a host's download start); peak RSS of every process and how memory divides between
them; the same run with a full-model save forced into every round; the telemetry's share of round time.

    python benchmarks/exchange.py [--json] [--models vit_base_patch16_224,vit_huge_patch14_224] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import beside, model_shapes, process_env, read_events, rss, spawn, stop, tail, wait_all, wait_ready

GOAL_AGG_TO_SYNC = 1.0
GOAL_APPLY = 1.0
GOAL_ENCODE_UPLOAD = 1.0
GOAL_COORDINATOR_RSS = 3.0  # x fp32 model size
GOAL_HOST_EXTRA = 2.0  # x fp32 model size, beyond the model
GOAL_TELEMETRY = 0.01


# -- the synthetic host (run by `nodeox launch`) ------------------------------------------------------------------


def host_main(args: argparse.Namespace) -> None:
    import resource

    import torch

    from lightning_nodeox.core.phases import PhaseLog
    from lightning_nodeox.host.client import HttpClient
    from lightning_nodeox.host.clock import ClockOffset
    from lightning_nodeox.host.heartbeat import Heartbeat
    from lightning_nodeox.host.round import HostRound
    from lightning_nodeox.host.telemetry import TelemetryShipper
    from lightning_nodeox.host.tensors import HostTensors

    torch.set_num_threads(1)
    host = os.environ["NODEOX_HOST_ID"]
    gen = torch.Generator().manual_seed(0)  # every host starts from the same model: no fetch at join
    named = [(n, torch.empty(s).uniform_(-0.05, 0.05, generator=gen)) for n, s in model_shapes(args.model)]
    model_bytes = sum(t.numel() * 4 for _, t in named)
    before = rss()
    clock = ClockOffset()
    client = HttpClient(os.environ["NODEOX_COORDINATOR_URL"], host=host, clock=clock, read_timeout=600)
    beat = Heartbeat(client)  # keeps the lease while a large model is encoded or applied
    phases = PhaseLog(host)
    shipper = TelemetryShipper(client, clock)
    phases.listeners.append(shipper)
    exchange = HostRound(HostTensors(named), client, phases, codec_threads=args.codec_threads)
    exchange.join()
    start = time.time()
    for r in range(args.rounds):
        with torch.no_grad():
            for i, (_, t) in enumerate(named):
                t.mul_(1.0 + 1e-3 * (int(host) + 1)).add_(1e-4 * (i % 7))  # this round's "training"
        if args.overlap and r < args.rounds - 1:  # the exchange as overlap runs it (memory: the snapshot)
            exchange.tensors.take_snapshot(restart_from_base=False)
            exchange.run_overlapped(32, delayed=False)
            exchange.tensors.fold()
        else:
            exchange.run_round(samples=32, final=r == args.rounds - 1)
    wall = time.time() - start
    beat.stop()
    shipper.close()
    client.leave()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out, f"host{host}.json").write_text(json.dumps({
        "model_bytes": model_bytes, "rss_with_model": before, "peak_rss": peak, "extra_bytes": peak - before,
        "telemetry_busy_s": shipper.busy_s, "rounds_wall_s": wall}))


# -- the benchmark ----------------------------------------------------------------------------------------------


def run_hosts(coordinator: list[str], hosts: list[list[str]], run_dir: Path, *, timeout: float) -> None:
    """Start ``coordinator`` (with ``--ready-file``), then host ``i`` as ``hosts[i]`` with ``NODEOX_HOST_ID=i``
    and ``NODEOX_COORDINATOR_URL``; wait for all, stop all in the end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = beside(run_dir, "logs")
    logs.mkdir(parents=True, exist_ok=True)
    ready, log = run_dir / "ready", logs / "coordinator.log"
    procs = [spawn([*coordinator, "--ready-file", str(ready)], log)]
    try:
        url = wait_ready(ready, procs[0], log)
        for i, cmd in enumerate(hosts):
            procs.append(spawn(cmd, logs / f"host{i}.log", env=process_env(NODEOX_HOST_ID=str(i),
                                                                        NODEOX_COORDINATOR_URL=url)))
        if any(wait_all(procs, timeout)):
            tails = "\n".join(f"--- {f.name} ---\n{tail(f, 40)}" for f in sorted(logs.glob("*.log")))
            raise RuntimeError(f"exchange run failed:\n{tails}")
    finally:
        stop(procs)


def saving_coordinator_main(args: argparse.Namespace) -> None:
    """A coordinator that also saves the full model before publishing every sync, on the critical path (what
    the study's system did), for comparison."""
    import asyncio

    from lightning_nodeox.coordinator.config import CoordinatorConfig
    from lightning_nodeox.coordinator.server import serve
    from lightning_nodeox.core.phases import COORDINATOR, MODEL_MATERIALIZE, PhaseRecord

    async def save(rounds, round_: int, message) -> None:
        start = time.time()
        size = await rounds.in_worker(rounds.model.save, Path(args.run_dir) / "model.safetensors", round_ + 1,
                                      message.meta.model_hash)
        rounds.record(PhaseRecord(round_, COORDINATOR, MODEL_MATERIALIZE, start, time.time(), size,
                                  extra={"to": "disk"}))

    config = CoordinatorConfig(hosts=2, run_dir=Path(args.run_dir), bind="127.0.0.1:0", rss_interval=0.5)
    raise SystemExit(asyncio.run(serve(config, Path(args.ready_file), before_publish=save)))


def run(model: str, rounds: int, save: bool, workdir: Path, overlap: bool = False) -> dict:
    run_dir, out = workdir / f"{model}{'-save' if save else ''}", workdir / f"out-{model}{'-save' if save else ''}"
    out.mkdir(parents=True, exist_ok=True)
    host = [sys.executable, __file__, "--host", "--model", model, "--rounds", str(rounds), "--out", str(out),
            *(["--overlap"] if overlap else [])]
    if save:
        coordinator = [sys.executable, __file__, "--saving-coordinator", "--run-dir", str(run_dir)]
    else:
        coordinator = [sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "2", "--run-dir",
                       str(run_dir), "--bind", "127.0.0.1:0", "--rss-interval", "0.5"]
    started = time.time()
    run_hosts(coordinator, [host, host], run_dir, timeout=1800)
    events = read_events(run_dir)
    hosts = {h: json.loads((out / f"host{h}.json").read_text()) for h in ("0", "1")}
    return {"model": model, "save_every_round": save, "wall_s": time.time() - started,
            **summarize(events, hosts, rounds)}


def summarize(events: list[dict], hosts: dict, rounds: int) -> dict:
    by = defaultdict(dict)  # (round, phase) -> host -> record
    for e in events:
        by[(e["round"], e["phase"])].setdefault(e["host"], e)
    counted = range(1, rounds) if rounds > 1 else range(rounds)

    def slowest(phase: str, hosts_=("0", "1"), fn=lambda e: e["end"] - e["start"]) -> float:
        return statistics.median(max(fn(by[(r, phase)][h]) for h in hosts_ if h in by[(r, phase)]) for r in counted)

    def coordinator(phase: str) -> float:
        return statistics.median(by[(r, phase)]["coordinator"]["end"] - by[(r, phase)]["coordinator"]["start"]
                                 for r in counted)

    def agg_to_sync(r: int) -> float:
        end = by[(r, "aggregate")]["coordinator"]["end"]
        return max(by[(r, "download")][h]["start"] - end for h in ("0", "1"))

    def host_sum(r: int, phases: tuple[str, ...]) -> float:
        return max(sum(by[(r, p)][h]["end"] - by[(r, p)][h]["start"] for p in phases) for h in ("0", "1"))

    saves = [e for e in events if e["phase"] == "model_materialize" and e.get("to") == "disk"]
    rss = [e for e in events if e["phase"] == "rss"]
    model_bytes = hosts["0"]["model_bytes"]
    coordinator_peak = max(e.get("peak_rss_bytes", e["rss_bytes"]) for e in rss)
    round_wall = statistics.median(
        max(by[(r, "verify")][h]["end"] for h in ("0", "1")) - min(by[(r, "encode")][h]["start"] for h in ("0", "1"))
        for r in counted)
    phases = {
        "encode": slowest("encode"), "upload": slowest("upload"), "aggregate": coordinator("aggregate"),
        "sync_prepare": coordinator("sync_prepare"), "download": slowest("download"), "apply": slowest("apply"),
        "verify": slowest("verify"), "aggregation_to_sync": statistics.median(agg_to_sync(r) for r in counted),
        "encode_upload": statistics.median(host_sum(r, ("encode", "upload")) for r in counted),
        "sync_application": statistics.median(host_sum(r, ("apply", "verify")) for r in counted),
        "round": round_wall,
    }
    if saves:
        phases["full_model_save"] = statistics.median(e["end"] - e["start"] for e in saves)
    telemetry = sum(h["telemetry_busy_s"] for h in hosts.values()) / sum(h["rounds_wall_s"] for h in hosts.values())
    return {
        "model_bytes": model_bytes, "parameters": model_bytes // 4, "median_s": phases,
        "memory": {
            "coordinator_peak_rss": coordinator_peak,
            "coordinator_peak_x_model": coordinator_peak / model_bytes,
            "coordinator_rss_after_rounds": [e["rss_bytes"] for e in rss][-1],
            "coordinator_baseline_rss": rss[0]["rss_bytes"],
            "coordinator_peak_beyond_baseline_x_model": (coordinator_peak - rss[0]["rss_bytes"]) / model_bytes,
            "hosts": {h: {"peak_rss": v["peak_rss"], "rss_with_model": v["rss_with_model"],
                          "extra_x_model": v["extra_bytes"] / model_bytes} for h, v in hosts.items()},
        },
        "telemetry_share_of_round_time": telemetry,
    }


def goals_for(result: dict) -> list[dict]:
    m = result["median_s"]
    mem = result["memory"]
    name = result["model"]
    host_extra = max(h["extra_x_model"] for h in mem["hosts"].values())
    return [
        {"goal": f"{name}: aggregation-to-sync <= {GOAL_AGG_TO_SYNC}s", "measured": m["aggregation_to_sync"],
         "met": m["aggregation_to_sync"] <= GOAL_AGG_TO_SYNC},
        {"goal": f"{name}: host sync application (apply+verify) <= {GOAL_APPLY}s", "measured": m["sync_application"],
         "met": m["sync_application"] <= GOAL_APPLY},
        {"goal": f"{name}: host encode+upload <= {GOAL_ENCODE_UPLOAD}s", "measured": m["encode_upload"],
         "met": m["encode_upload"] <= GOAL_ENCODE_UPLOAD},
        {"goal": f"{name}: coordinator peak RSS <= {GOAL_COORDINATOR_RSS}x fp32 model",
         "measured": mem["coordinator_peak_x_model"], "met": mem["coordinator_peak_x_model"] <= GOAL_COORDINATOR_RSS},
        {"goal": f"{name}: host memory beyond the model <= {GOAL_HOST_EXTRA}x fp32 model", "measured": host_extra,
         "met": host_extra <= GOAL_HOST_EXTRA},
        {"goal": f"{name}: telemetry < {GOAL_TELEMETRY:.0%} of round time", "measured": result["telemetry_share_of_round_time"],
         "met": result["telemetry_share_of_round_time"] < GOAL_TELEMETRY},
    ]


def print_result(r: dict) -> None:
    gib = 2**30
    print(f"\n== {r['model']} ({r['parameters'] / 1e6:.0f}M parameters, {r['model_bytes'] / gib:.2f} GiB fp32)"
          f"{' with a full-model save forced every round' if r['save_every_round'] else ''}")
    for phase, s in r["median_s"].items():
        print(f"  {phase:22} {s:8.3f} s")
    mem = r["memory"]
    print(f"  coordinator peak RSS   {mem['coordinator_peak_rss'] / gib:8.2f} GiB ({mem['coordinator_peak_x_model']:.2f}x "
          f"model; {mem['coordinator_peak_beyond_baseline_x_model']:.2f}x beyond its {mem['coordinator_baseline_rss'] / gib:.2f} "
          f"GiB start-up), after the last round {mem['coordinator_rss_after_rounds'] / gib:.2f} GiB")
    for h, v in mem["hosts"].items():
        print(f"  host {h} peak RSS        {v['peak_rss'] / gib:8.2f} GiB (model loaded: {v['rss_with_model'] / gib:.2f} "
              f"GiB; exchange adds {v['extra_x_model']:.2f}x model)")
    total = mem["coordinator_peak_rss"] + sum(v["peak_rss"] for v in mem["hosts"].values())
    print(f"  all processes, peaks   {total / gib:8.2f} GiB; telemetry {r['telemetry_share_of_round_time']:.3%} of "
          f"round time")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--models", default="vit_base_patch16_224,vit_huge_patch14_224")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--overlap", action="store_true", help="hosts exchange as overlap mode does (snapshot and fold)")
    p.add_argument("--no-save-comparison", action="store_true", help="skip the runs with a forced full-model save")
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--saving-coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--codec-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.host:
        host_main(args)
        return
    if args.saving_coordinator:
        saving_coordinator_main(args)
    results, goals = [], []
    with tempfile.TemporaryDirectory(prefix="nodeox-exchange-") as tmp:
        for model in args.models.split(","):
            for save in (False,) if args.no_save_comparison else (False, True):
                result = run(model, args.rounds, save, Path(tmp), args.overlap)
                results.append(result)
                if not save:
                    goals += goals_for(result)
                if not args.json:
                    print_result(result)
    if args.json:
        print(json.dumps({"results": results, "goals": goals}, indent=2))
        return
    print("\ngoals:")
    for g in goals:
        print(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.3f}")


if __name__ == "__main__":
    main()
