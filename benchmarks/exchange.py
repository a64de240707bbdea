"""The exchange alone, at ViT-B/16 and ViT-H/14 parameter counts: a coordinator and 2 hosts on this machine.

Hosts hold a synthetic model with the real models' tensor shapes (timm, built on the meta device) and do no
training compute: each round they nudge every tensor and run a real exchange (encode, upload, wait,
download, apply, verify). With ``--mbit``, each host sits in a network namespace of its own whose veth to the
coordinator's hub is shaped to that rate both ways (benchmarks/netns.py; needs root); otherwise all on loopback.

The exchange is streamed: every phase of a round spans most of it and overlaps the others, so a round is judged
as a whole (medians over rounds; the first, which pays for first-touch allocations, left out):

- round: the first host's encode start to the last host's verify end;
- critical path: the round cut where its last delta was in (the last upload's end), its sync's last piece made
  (the coordinator's sync_prepare end) and the sync's last byte at the last host (its download end); each part
  is what the round still waited on that stage once the one before had ended, and the parts add up to the round;
- duplex floor (``--mbit`` only): one transfer of the largest body one host moved one way (its delta up or its
  sync down) at the link's rate, since up and down go at once on a duplex link; and round / floor.

Also printed, as information only: each phase's median over rounds of the slowest host (they overlap, so they do
not add up to the round), and aggregation-to-sync (aggregate end to a host's download start: negative when hosts
start downloading before the last delta is in); peak RSS of every process and how memory divides between them;
the same run with a full-model save forced into every round; the telemetry's share of round time. Each run is
appended to a JSON-lines file as it ends (``--results``); a run that fails is recorded there and the next runs.

    python benchmarks/exchange.py [--json] [--models vit_base_patch16_224,vit_huge_patch14_224] [--rounds 4]
        [--mbit 200] [--no-save-comparison] [--results FILE]
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

from common import (
    SampleLog,
    add_results_option,
    beside,
    failure_lines,
    model_shapes,
    process_env,
    read_events,
    rss,
    spawn,
    stop,
    tail,
    wait_all,
    wait_ready,
)
from netns import Loopback, Namespaces, Net, netns_missing
from peers_figures import FLOOR_AT_MBIT, GOAL_FLOOR, critical_path, host_payload

PREFIX, SUBNET = "nxex", "10.79.0"  # not benchmarks/peers.py's or sites.py's: they can run side by side
PHASES = ("encode", "upload", "aggregate", "sync_prepare", "download", "apply", "verify")
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


def run_hosts(coordinator: list[str], hosts: list[list[str]], run_dir: Path, net: Net, *, timeout: float) -> None:
    """Start ``coordinator`` (with ``--ready-file``) in ``net``'s hub, then host ``i`` as ``hosts[i]`` in site
    ``i`` with ``NODEOX_HOST_ID=i`` and ``NODEOX_COORDINATOR_URL``; wait for all, stop all in the end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = beside(run_dir, "logs")
    logs.mkdir(parents=True, exist_ok=True)
    ready, log = run_dir / "ready", logs / "coordinator.log"
    procs = [spawn([*net.exec(None), *coordinator, "--ready-file", str(ready)], log)]
    try:
        url = wait_ready(ready, procs[0], log)
        for i, cmd in enumerate(hosts):
            procs.append(spawn([*net.exec(i), *cmd], logs / f"host{i}.log",
                               env=process_env(NODEOX_HOST_ID=str(i), NODEOX_COORDINATOR_URL=url)))
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

    config = CoordinatorConfig(hosts=2, run_dir=Path(args.run_dir), bind=args.bind, rss_interval=0.5,
                               insecure=args.insecure)
    raise SystemExit(asyncio.run(serve(config, Path(args.ready_file), before_publish=save)))


def run(model: str, rounds: int, save: bool, workdir: Path, net: Net, overlap: bool = False) -> dict:
    run_dir, out = workdir / f"{model}{'-save' if save else ''}", workdir / f"out-{model}{'-save' if save else ''}"
    out.mkdir(parents=True, exist_ok=True)
    host = [sys.executable, __file__, "--host", "--model", model, "--rounds", str(rounds), "--out", str(out),
            *(["--overlap"] if overlap else [])]
    # on a hub namespace's address (not loopback) without a token: the namespaces are private
    where = ["--bind", f"{net.hub_ip}:0", *(["--insecure"] if net.counted else [])]
    if save:
        coordinator = [sys.executable, __file__, "--saving-coordinator", "--run-dir", str(run_dir), *where]
    else:
        coordinator = [sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", "2", "--run-dir",
                       str(run_dir), "--rss-interval", "0.5", *where]
    started = time.time()
    run_hosts(coordinator, [host, host], run_dir, net, timeout=1800)
    events = read_events(run_dir)
    hosts = {h: json.loads((out / f"host{h}.json").read_text()) for h in ("0", "1")}
    return {"model": model, "save_every_round": save, "mbit": net.mbit, "wall_s": time.time() - started,
            **summarize(events, hosts, rounds), "round": judge_round(events, rounds, net.mbit)}


def judge_round(events: list[dict], rounds: int, mbit: float | None) -> dict:
    """What a streamed round is judged by: its wall time and critical path (medians over rounds), its payload
    (the largest body one host moved one way) and, on a link of ``mbit`` Mbit/s, the duplex floor (one transfer of
    the payload: up and down go at once) and round / floor (None on loopback: no link rate)."""
    counted = range(1, rounds) if rounds > 1 else range(rounds)
    paths = [critical_path(events, r) for r in counted]
    payload = host_payload(events)
    wall = statistics.median(p["round"] for p in paths)
    parts = {part: statistics.median(p[part] for p in paths) for part in paths[0] if part != "round"}
    payload_bytes = statistics.median(payload.get(r, 0) for r in counted)
    floor = payload_bytes * 8 / (mbit * 1e6) if mbit else None
    return {"wall_s": wall, "critical_path_s": parts, "payload_bytes": payload_bytes, "floor_s": floor,
            "round_over_floor": None if floor is None else wall / floor}


def summarize(events: list[dict], hosts: dict, rounds: int) -> dict:
    by = defaultdict(dict)  # (round, phase) -> host -> record
    for e in events:
        by[(e["round"], e["phase"])].setdefault(e["host"], e)
    counted = range(1, rounds) if rounds > 1 else range(rounds)

    def slowest(phase: str, hosts_=("0", "1"), fn=lambda e: e["end"] - e["start"]) -> float:
        return statistics.median(max(fn(by[(r, phase)][h]) for h in hosts_ if h in by[(r, phase)]) for r in counted)

    def agg_to_sync(r: int) -> float:
        end = by[(r, "aggregate")]["coordinator"]["end"]
        return max(by[(r, "download")][h]["start"] - end for h in ("0", "1"))

    saves = [e for e in events if e["phase"] == "model_materialize" and e.get("to") == "disk"]
    rss = [e for e in events if e["phase"] == "rss"]
    model_bytes = hosts["0"]["model_bytes"]
    coordinator_peak = max(e.get("peak_rss_bytes", e["rss_bytes"]) for e in rss)
    phases = {p: slowest(p, ("coordinator",) if p in ("aggregate", "sync_prepare") else ("0", "1")) for p in PHASES}
    phases["aggregation_to_sync"] = statistics.median(agg_to_sync(r) for r in counted)
    if saves:
        phases["full_model_save"] = statistics.median(e["end"] - e["start"] for e in saves)
    telemetry = sum(h["telemetry_busy_s"] for h in hosts.values()) / sum(h["rounds_wall_s"] for h in hosts.values())
    return {
        "model_bytes": model_bytes, "parameters": model_bytes // 4, "overlapping_phases_s": phases,
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
    mem = result["memory"]
    name = result["model"]
    host_extra = max(h["extra_x_model"] for h in mem["hosts"].values())
    out = []
    mbit, ratio = result["mbit"], result["round"]["round_over_floor"]
    if mbit is not None and mbit <= FLOOR_AT_MBIT:  # where the link, not the CPU, should bound the round
        out.append({"goal": f"{name}: round <= {GOAL_FLOOR:g}x the duplex floor at {mbit:g} Mbit/s",
                    "measured": ratio, "met": ratio <= GOAL_FLOOR})
    return out + [
        {"goal": f"{name}: coordinator peak RSS <= {GOAL_COORDINATOR_RSS}x fp32 model",
         "measured": mem["coordinator_peak_x_model"], "met": mem["coordinator_peak_x_model"] <= GOAL_COORDINATOR_RSS},
        {"goal": f"{name}: host memory beyond the model <= {GOAL_HOST_EXTRA}x fp32 model", "measured": host_extra,
         "met": host_extra <= GOAL_HOST_EXTRA},
        {"goal": f"{name}: telemetry < {GOAL_TELEMETRY:.0%} of round time", "measured": result["telemetry_share_of_round_time"],
         "met": result["telemetry_share_of_round_time"] < GOAL_TELEMETRY},
    ]


def print_round(r: dict) -> None:
    judged = r["round"]
    path = judged["critical_path_s"]
    print(f"  round                  {judged['wall_s']:8.3f} s  (first encode start to last verify end)")
    print(f"  critical path          delta in {path['delta_in']:.3f} s, sync made +{path['sync_made']:.3f} s, "
          f"sync out +{path['sync_out']:.3f} s, verified +{path['verified']:.3f} s")
    if judged["floor_s"] is None:
        print(f"  duplex floor           - (loopback: no link rate; --mbit shapes each host's link); payload "
              f"{judged['payload_bytes'] / 1e6:.1f} MB")
    else:
        print(f"  duplex floor           {judged['floor_s']:8.3f} s  ({judged['payload_bytes'] / 1e6:.1f} MB each way "
              f"per host at {r['mbit']:g} Mbit/s, up and down at once); round / floor "
              f"{judged['round_over_floor']:.2f}x")
    print("  phases (overlapping: each spans part of the streamed round; they do not add up to it):")
    for phase, s in r["overlapping_phases_s"].items():
        print(f"    {phase:20} {s:8.3f} s")


def print_result(r: dict) -> None:
    gib = 2**30
    link = "loopback" if r["mbit"] is None else f"each host's link {r['mbit']:g} Mbit/s each way"
    print(f"\n== {r['model']} ({r['parameters'] / 1e6:.0f}M parameters, {r['model_bytes'] / gib:.2f} GiB fp32), {link}"
          f"{' with a full-model save forced every round' if r['save_every_round'] else ''}")
    print_round(r)
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


def run_all(args: argparse.Namespace, net: Net, workdir: Path) -> tuple[list[dict], list[dict], SampleLog]:
    """Every model, without and with the forced save: the results, their goals and the log of every run."""
    log = SampleLog("exchange", args.results)
    results, goals = [], []
    for model in args.models.split(","):
        for save in (False,) if args.no_save_comparison else (False, True):
            with log.sample({"model": model, "save_every_round": save, "mbit": net.mbit}) as taken:
                taken.result = run(model, args.rounds, save, workdir, net, args.overlap)
            if taken.failed:
                continue
            results.append(taken.result)
            if not save:
                goals += goals_for(taken.result)
            if not args.json:
                print_result(taken.result)
    return results, goals, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--models", default="vit_base_patch16_224,vit_huge_patch14_224")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mbit", type=float, help="shape each host's link to this many Mbit/s each way (network "
                   "namespaces; needs root); default: all on loopback, unshaped")
    p.add_argument("--overlap", action="store_true", help="hosts exchange as overlap mode does (snapshot and fold)")
    p.add_argument("--no-save-comparison", action="store_true", help="skip the runs with a forced full-model save")
    add_results_option(p)
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--saving-coordinator", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--bind", default="127.0.0.1:0", help=argparse.SUPPRESS)
    p.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--codec-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.host:
        host_main(args)
        return
    if args.saving_coordinator:
        saving_coordinator_main(args)
    if args.mbit is not None and (why := netns_missing()):
        p.error(f"--mbit needs network namespaces: {why}; leave --mbit out to run on loopback")
    net = Loopback(2) if args.mbit is None else Namespaces(2, args.mbit, PREFIX, SUBNET)
    with net, tempfile.TemporaryDirectory(prefix="nodeox-exchange-") as tmp:
        results, goals, log = run_all(args, net, Path(tmp))
    if args.json:
        print(json.dumps({"results": results, "goals": goals, "failed": log.failures}, indent=2))
        return
    for line in failure_lines(log.failures, str(log.path)):
        print(line)
    print("\ngoals:")
    for g in goals:
        print(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.3f}")


if __name__ == "__main__":
    main()
