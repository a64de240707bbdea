"""nodeox against its peers at ViT-B size, 2 hosts: torchft's fp32 DiLoCo and, for scale, DDP's gloo all-reduce
per step; on an unlimited link and on host links limited with ``tc tbf``.

Each host is a network namespace of its own whose one veth to a hub namespace is its link, shaped both ways
(benchmarks/netns.py; "unlimited": not shaped); what serves the hosts sits in the hub (nodeox's coordinator,
torchft's lighthouse). This kernel has no netem: links are limited in bandwidth, never delayed. Where namespaces
are not permitted (not root, no ``ip`` or ``tc``), or with ``--loopback``, only the unlimited link runs, every
process on loopback, and links' bytes are not counted. Placements, per link interleaved ``--repeats`` times
(nodeox, torchft, ddp, nodeox, ...), synthetic steps (the model's tensor shapes, no data, no training compute):

- nodeox: ``nodeox coordinator --hosts 2`` and benchmarks/exchange.py's hosts (``--host``: a real exchange each
  round, q4 delta up, q4 sync down).
- torchft: its DiLoCo, fp32 over gloo, one replica per host (benchmarks/sites_torchft.py): one sync a round.
  Needs torchft (``pip install -e ".[peers]"``, or a venv passed as ``--torchft-python``); else skipped, saying so.
- ddp: a step of torch's DistributedDataParallel over gloo: one all-reduce of every fp32 gradient (in its 25 MB
  buckets), what DDP sends every step; for scale.

Per round (round 0, which pays for the first model transfer and first-touch allocations, is left out):
round: the last host's round end (nodeox: its verify end; torchft, ddp: its step's end) since the round before's;
sync: the last host's delta sent (nodeox: its upload end; torchft, ddp: the step's start) to its sync applied;
MB per host up / down: the hosts' veth counters in the round's window; nodeox's payload: the largest delta or sync
body one host moved (its records), whose one transfer over the link is the duplex floor of a round. Figures: the
median over runs of each run's median over rounds [min-max over runs]. nodeox's phases: per phase the median over
rounds of the slowest host (and the coordinator's aggregate and sync_prepare), from events.jsonl.

Each run is appended to a JSON-lines file as it ends (``--results``); a run that fails (a worker, a link's
counters) is recorded there with its reason and the next one runs.

    python benchmarks/peers.py [--json] [--rounds 4] [--repeats 2] [--links unlimited,1000,200]
        [--placements nodeox,torchft,ddp] [--torchft-python PY] [--model vit_base_patch16_224]
        [--loopback] [--run-dir DIR] [--timeout 900] [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

from common import (
    SampleLog,
    add_results_option,
    beside,
    coordinator_command,
    failure_lines,
    interleaved,
    model_shapes,
    process_env,
    read_events,
    run_async,
    spawn,
    stop,
    wait_ready,
)
from netns import Counters, Loopback, Namespaces, Net, netns_missing, watch
from peers_figures import METRICS, goals, host_payload, link_label, phase_figures, slowest_phases
from site_figures import (
    PlacementFailed,
    latest_times,
    mem_available,
    nodeox_times,
    per_round,
    placement_figures,
    run_figures,
)

EXCHANGE = Path(__file__).with_name("exchange.py")
TORCHFT = Path(__file__).with_name("sites_torchft.py")
PLACEMENTS = ("nodeox", "torchft", "ddp")
HOSTS = 2
PREFIX, SUBNET = "nxpr", "10.78.0"  # not benchmarks/sites.py's: the two can run side by side
DDP_PORT = 29520


# -- a DDP worker (its own process) -------------------------------------------------------------------------------


def ddp_main(args: argparse.Namespace) -> None:
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)  # every worker starts alike: no broadcast at start (init_sync=False)
    shapes = json.loads(Path(args.shapes).read_text())
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(s).uniform_(-0.05, 0.05, generator=gen))
                                    for _, s in shapes)

    class Synthetic(torch.nn.Module):
        """A loss that touches every tensor at almost no compute: its backward is a dense gradient per tensor."""

        def __init__(self) -> None:
            super().__init__()
            self.params = params

        def forward(self) -> torch.Tensor:
            return torch.stack([p.view(-1)[0] for p in self.params]).sum()

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{DDP_PORT}", rank=args.index,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    model = DistributedDataParallel(Synthetic(), init_sync=False)
    optimizer = torch.optim.SGD(params, lr=1e-3)
    times = []
    for r in range(args.rounds):
        sent = time.time()
        model().backward()  # DDP's hooks all-reduce the gradients' buckets as backward produces them
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        done = time.time()
        times.append({"round": r, "sent": sent, "applied": done, "done": done})
    dist.destroy_process_group()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out).write_text(json.dumps({"rounds": times, "peak_rss": peak}))


# -- the placements -----------------------------------------------------------------------------------------------


def new_memory() -> dict:
    return {"start_available": mem_available(), "min_available": mem_available()}


def memory_figures(memory: dict, peaks: dict[str, float | None]) -> dict:
    return {"used_gib": (memory["start_available"] - memory["min_available"]) / 2**30, "peak_rss_mib": peaks}


def byte_windows(counters: Counters) -> dict:
    """What per_round counts in each round's window: bytes per host, each way (where links are counted)."""
    return {"up_bytes": counters.up_per_site, "down_bytes": counters.down_per_site} if counters.counted else {}


async def run_nodeox(net: Net, args: argparse.Namespace, run_dir: Path) -> dict:
    out, logs = beside(run_dir, "out"), beside(run_dir, "logs")
    for d in (run_dir, out, logs):
        d.mkdir(parents=True, exist_ok=True)
    ready, log = run_dir / "ready", logs / "coordinator.log"
    ready.unlink(missing_ok=True)
    memory, counters = new_memory(), Counters(net)
    workers: dict[str, subprocess.Popen] = {}
    try:
        # --insecure: on a hub namespace's address (not loopback) without a token; the namespaces are private
        workers["coordinator"] = spawn([*net.exec(None), *coordinator_command(
            HOSTS, run_dir, ready, "--insecure", bind=f"{net.hub_ip}:0")], log)
        try:
            url = await asyncio.to_thread(wait_ready, ready, workers["coordinator"], log)
        except RuntimeError as e:
            raise PlacementFailed(str(e)) from None
        for h in range(HOSTS):
            workers[f"host{h}"] = spawn(
                [*net.exec(h), sys.executable, str(EXCHANGE), "--host", "--model", args.model, "--rounds",
                 str(args.rounds), "--out", str(out)], logs / f"host{h}.log",
                env=process_env(NODEOX_HOST_ID=str(h), NODEOX_COORDINATOR_URL=url))
        await watch(workers, {}, counters, memory, args.timeout, logs)
    finally:
        stop(list(workers.values()), grace=10)
    records = read_events(run_dir)
    rounds = per_round(nodeox_times(records), windows=byte_windows(counters))
    payload = host_payload(records)
    for rnd in rounds:
        rnd["payload_bytes"] = payload.get(rnd["round"], 0)
    peaks = {f"host{h}": json.loads((out / f"host{h}.json").read_text())["peak_rss"] / 2**20 for h in range(HOSTS)}
    peaks["coordinator"] = max((r.get("peak_rss_bytes", r["rss_bytes"]) / 2**20 for r in records
                                if r["phase"] == "rss" and r["host"] == "coordinator"), default=None)
    return {"rounds": rounds, **run_figures(rounds, METRICS), "phases": slowest_phases(records),
            "memory": memory_figures(memory, peaks)}


async def run_torchft(net: Net, args: argparse.Namespace, run_dir: Path) -> dict:
    from sites_torchft import run_diloco

    outs, counters, memory = await run_diloco(net, args.torchft_python, args.model, args.rounds, args.timeout,
                                              run_dir, per_site=1)
    rounds = per_round(latest_times([o["rounds"] for o in outs]), windows=byte_windows(counters))
    peaks = {f"replica{i}": o["peak_rss"] / 2**20 for i, o in enumerate(outs)}
    return {"rounds": rounds, **run_figures(rounds, METRICS), "memory": memory_figures(memory, peaks)}


async def run_ddp(net: Net, args: argparse.Namespace, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    shapes = run_dir / "shapes.json"
    shapes.write_text(json.dumps(model_shapes(args.model)))
    memory, counters = new_memory(), Counters(net)
    workers: dict[str, subprocess.Popen] = {}
    try:
        for h in range(HOSTS):
            workers[f"ddp{h}"] = spawn(
                [*net.exec(h), sys.executable, __file__, "--ddp-worker", "--index", str(h), "--world", str(HOSTS),
                 "--master", net.ip(0), "--shapes", str(shapes), "--rounds", str(args.rounds), "--timeout",
                 str(args.timeout), "--out", str(run_dir / f"ddp{h}.json")], run_dir / f"ddp{h}.log",
                env=process_env(GLOO_SOCKET_IFNAME=net.dev(h)))
        await watch(workers, {}, counters, memory, args.timeout, run_dir)
    finally:
        stop(list(workers.values()), grace=5)
    outs = [json.loads((run_dir / f"ddp{h}.json").read_text()) for h in range(HOSTS)]
    rounds = per_round(latest_times([o["rounds"] for o in outs]), windows=byte_windows(counters))
    peaks = {f"ddp{h}": o["peak_rss"] / 2**20 for h, o in enumerate(outs)}
    return {"rounds": rounds, **run_figures(rounds, METRICS), "memory": memory_figures(memory, peaks)}


RUNS = {"nodeox": run_nodeox, "torchft": run_torchft, "ddp": run_ddp}


# -- all links ----------------------------------------------------------------------------------------------------


async def run_link(net: Net, args: argparse.Namespace, workdir: Path, skipped: dict[str, str],
                   log: SampleLog) -> dict:
    """Every placement on one link, interleaved: ``{placement: [run, ...]}``, each run in ``log`` as it ends (a
    failed one too, and the next one runs); what cannot run here goes to ``skipped`` (placement -> why) and is not
    tried again."""
    runs = await interleaved(args.placements, args.repeats,
                             lambda placement, rep: RUNS[placement](net, args, workdir / f"{placement}-{rep}"),
                             skipped, link_label(net.mbit), METRICS, log)
    return {p: r for p, r in runs.items() if r}


async def run_all(args: argparse.Namespace, workdir: Path) -> dict:
    skipped: dict[str, str] = {}
    notes: list[str] = []
    log = SampleLog("peers", args.results)
    if "torchft" in args.placements:
        from sites_torchft import torchft_missing

        if reason := torchft_missing(args.torchft_python):
            skipped["torchft"] = reason
    links: list[float | None] = args.links
    why = "--loopback" if args.loopback else netns_missing()
    if why:
        limited = [link_label(m) for m in links if m is not None]
        notes.append(f"no network namespaces ({why}): the unlimited link on loopback, bytes not counted"
                     + (f"; {', '.join(limited)} not run" if limited else ""))
        links = [None] if None in links else []
    runs: dict[str, dict[str, list[dict]]] = {}
    for mbit in links:
        label = link_label(mbit)
        net = Loopback(HOSTS) if why else Namespaces(HOSTS, mbit, PREFIX, SUBNET)
        with net:
            runs[label] = await run_link(net, args, workdir / label.replace(" ", "").replace("/", ""), skipped, log)
    figures = {label: {p: {**placement_figures(r, METRICS), **({"phases": phase_figures(r)} if p == "nodeox" else {})}
                       for p, r in by.items()} for label, by in runs.items()}
    rates = {link_label(m): m for m in links}
    return {"model": args.model, "hosts": HOSTS, "rounds": args.rounds, "repeats": args.repeats,
            "netns": not why, "notes": notes, "rates_mbit": rates, "figures": figures,
            "goals": goals(figures, rates), "skipped": skipped, "failed": log.failures, "results": str(log.path),
            "runs": runs}


def render(result: dict) -> str:
    where = ("  each host in its own network namespace, its veth to the hub shaped both ways by tc tbf (no delay: "
             "no netem here)") if result["netns"] else "  all on loopback"
    lines = [(f"{result['model']}: {result['hosts']} hosts, {result['rounds']} rounds (round 0 left out), "
              f"{result['repeats']} run(s) per placement and link, interleaved; synthetic steps (no data, no compute)"),
             where, *(f"  {n}" for n in result["notes"]),
             "  figures: median over runs of each run's median over rounds [min-max over runs]", "",
             (f"  {'link':12} {'placement':9} {'round s':>20} {'sync s':>20} {'MB/host/round up / down':>26} "
              f"{'mem GiB':>8}")]

    def cell(fig: dict, metric: str, scale: float = 1.0) -> str:
        if metric not in fig:
            return "-"
        s = fig[metric]
        return f"{s['median'] / scale:.2f} [{s['min'] / scale:.2f}-{s['max'] / scale:.2f}]"

    for label, by in result["figures"].items():
        for placement, fig in by.items():
            mem = max(run["memory"]["used_gib"] for run in result["runs"][label][placement])
            updown = "-" if "up_bytes" not in fig else \
                f"{fig['up_bytes']['median'] / 1e6:.1f} / {fig['down_bytes']['median'] / 1e6:.1f}"
            lines.append(f"  {label:12} {placement:9} {cell(fig, 'round_s'):>20} {cell(fig, 'delta_to_sync_s'):>20} "
                         f"{updown:>26} {mem:>8.1f}")
    for placement, reason in result["skipped"].items():
        lines.append(f"  {placement} skipped: {reason}")
    lines += failure_lines(result["failed"], result["results"])
    lines += ["", ("nodeox's phases, s (per phase the median over rounds of the slowest host; aggregate and "
                   "sync_prepare: the coordinator's), and payload (largest body one host moved one way):")]
    for label, by in result["figures"].items():
        if "nodeox" in by:
            fig = by["nodeox"]
            lines.append(f"  {label:12} " + " ".join(f"{p} {s['median']:.2f}" for p, s in fig["phases"].items())
                         + f"; payload {fig['payload_bytes']['median'] / 1e6:.1f} MB")
    lines += ["", "goals (the streaming exchange of issue 18 is meant to meet them):"]
    for g in result["goals"]:
        lines.append(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.2f}x "
                     f"[{g['range'][0]:.2f}-{g['range'][1]:.2f}]")
    if not result["goals"]:
        lines.append("  none measured (a placement they compare did not run)")
    return "\n".join(lines)


def parse_links(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        if part == "unlimited":
            out.append(None)
            continue
        try:
            mbit = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"link {part!r}: give Mbit/s (e.g. 200) or 'unlimited'") from None
        if mbit <= 0:
            raise argparse.ArgumentTypeError(f"link {part!r}: Mbit/s must be positive")
        out.append(mbit)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--links", type=parse_links, default=parse_links("unlimited,1000,200"),
                   help="host links, comma-separated: Mbit/s each way, or 'unlimited' (default unlimited,1000,200)")
    p.add_argument("--placements", default=",".join(PLACEMENTS))
    p.add_argument("--torchft-python", type=Path, default=Path(sys.executable),
                   help="a Python with torch and torchft (default: this one)")
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--loopback", action="store_true", help="no namespaces: the unlimited link only, on loopback")
    p.add_argument("--run-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take")
    add_results_option(p)
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    for name, kind in (("--index", int), ("--world", int), ("--master", str), ("--shapes", str), ("--out", str)):
        p.add_argument(name, type=kind, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ddp_worker:
        ddp_main(args)
        return
    args.placements = args.placements.split(",")
    unknown = set(args.placements) - set(PLACEMENTS)
    if unknown:
        p.error(f"unknown placement(s) {', '.join(sorted(unknown))}: choose from {', '.join(PLACEMENTS)}")
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 0 is left out)")
    result = run_async(lambda workdir: run_all(args, workdir), args.run_dir, "peers")
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
