"""torchft's fp32 DiLoCo over emulated links: the torchft row of benchmarks/sites.py (2 sites x 4 replicas, over
the same far links) and of benchmarks/peers.py (2 hosts, one replica each).

torchft's replicas all-reduce among themselves (gloo), so what crosses the WAN is the traffic BETWEEN the sites:
each site is a network namespace whose one veth to a hub namespace is its far link (benchmarks/netns.py), shaped
with ``tc tbf`` to the far rate in both directions. The replicas of a site share its namespace: among themselves they talk over its loopback (the near network, unshaped). The
lighthouse sits in the hub. This kernel has no netem and gloo connects straight to the addresses its peers
advertise (no proxy can stand in the way), so the far links' DELAY is not emulated for this row: its times are a
lower bound (each of the ring's 2(N-1) steps per all-reduce would add about a one-way delay per tensor).

Each replica: a module with the model's floating-point tensor shapes (seeded alike, ``init_sync=False``: no
checkpoint transfer at start, as the nodeox hosts start alike), a ``Manager`` (its own TCPStore, gloo,
``min_replica_size`` = all replicas, advertising its site's address), ``DiLoCo(sync_every=1)`` with torchft's
defaults (fp32, one all-reduce per tensor): each round a synthetic gradient, one inner SGD step, which syncs.
It writes per round the step's start (``sent``: the pseudogradient is taken and the all-reduce starts) and end
(``applied`` = ``done``: the outer step applied). Far bytes: the sites' veth counters, sampled.

Needs a Python with torch and torchft (``--torchft-python``; e.g. a venv with ``pip install torch torchft``), and
for namespaces root, ``ip`` and ``tc``. Each replica advertises its own site's address: gloo's device
(``GLOO_SOCKET_IFNAME``: the site's veth) and the ``hostname`` its Manager gives the lighthouse (the name its
checkpoint server and store are reached by). Run as a replica or the lighthouse by benchmarks/sites.py or
benchmarks/peers.py, not by hand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from netns import Counters, Namespaces, Net, netns_missing, watch

LIGHTHOUSE_PORT = 29510


# -- in the replica's process (torchft's Python) ------------------------------------------------------------------


def replica_main(args: argparse.Namespace) -> None:
    import resource
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    shapes = json.loads(Path(args.shapes).read_text())
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    for i, (_, shape) in enumerate(shapes):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(shape).uniform_(-0.05, 0.05, generator=gen)))
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    store = TCPStore(args.address, 0, is_master=True, wait_for_workers=False)
    long = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=long), load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
        state_dict=lambda: {"model": model.state_dict()}, min_replica_size=args.replicas, use_async_quorum=False,
        replica_id=args.replica_id, store_addr=args.address, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, hostname=args.address, init_sync=False, timeout=long,
        quorum_timeout=long, connect_timeout=long)
    times = []
    with DiLoCo(manager, [model], inner, outer, sync_every=1, backup_device=torch.device("cpu"),
                pin_memory=False):
        for r in range(args.rounds):
            with torch.no_grad():  # this round's "training", in place as the nodeox hosts do (no grads held)
                for i, p in enumerate(model.parameters()):
                    p.mul_(1.0 + 1e-3 * (args.index + 1)).add_(1e-4 * (i % 7))
            sent = time.time()
            inner.step()  # no grads: SGD leaves the model; DiLoCo's hook: quorum, all-reduce, outer step
            done = time.time()
            times.append({"round": r, "sent": sent, "applied": done, "done": done,
                          "step": manager.current_step()})
    manager.shutdown(wait=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(args.out).write_text(json.dumps({"rounds": times, "peak_rss": peak}))


def lighthouse_main(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=f"[::]:{LIGHTHOUSE_PORT}", min_replicas=args.replicas, join_timeout_ms=60_000)
    print(f"lighthouse {server.address()}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


# -- in the benchmark's process -----------------------------------------------------------------------------------


def torchft_missing(python: Path) -> str | None:
    """Why torchft cannot run from ``python``, or None."""
    probe = subprocess.run([str(python), "-c", "import torchft"], check=False, capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return (f"torchft does not import in {python} ({last}); make a venv with `pip install torch torchft` "
                "(or this project's `.[peers]` extra) and pass --torchft-python VENV/bin/python")
    return None


def torchft_env(**extra: str) -> dict[str, str]:
    """A replica's environment: torchft's own Python and packages (not this project's PYTHONPATH)."""
    from common import process_env

    return {k: v for k, v in process_env(**extra).items() if k != "PYTHONPATH"}


async def run_diloco(net: Net, python: Path, model: str, rounds: int, timeout: float, run_dir: Path,
                     per_site: int) -> tuple[list[dict], Counters, dict]:
    """torchft's DiLoCo with ``per_site`` replicas in each site of ``net`` (entered), the lighthouse in its hub:
    each replica's output (its rounds' times and peak RSS), the sites' link counters and the run's memory."""
    from common import model_shapes, spawn, stop
    from site_figures import PlacementFailed, mem_available

    run_dir.mkdir(parents=True, exist_ok=True)
    shapes = run_dir / "shapes.json"
    shapes.write_text(json.dumps(model_shapes(model)))
    replicas = net.sites * per_site
    env = torchft_env()
    workers: dict[str, subprocess.Popen] = {}
    memory = {"start_available": mem_available(), "min_available": mem_available()}
    counters = Counters(net)
    try:
        lighthouse = spawn([*net.exec(None), str(python), __file__, "--serve-lighthouse", "--replicas",
                            str(replicas)], run_dir / "lighthouse.log", env=env)
        services = {"lighthouse": lighthouse}
        for s in range(net.sites):
            for k in range(per_site):
                i = s * per_site + k  # ids sort by site: the ring crosses between the sites twice, not 2 x 4
                workers[f"replica{i}"] = spawn(
                    [*net.exec(s), str(python), __file__, "--replica", "--index", str(i), "--replica-id",
                     f"s{s}r{k}", "--replicas", str(replicas), "--address", net.ip(s), "--lighthouse",
                     f"http://{net.hub_ip}:{LIGHTHOUSE_PORT}", "--shapes", str(shapes), "--rounds", str(rounds),
                     "--timeout", str(timeout), "--out", str(run_dir / f"replica{i}.json")],
                    run_dir / f"replica{i}.log", env={**env, "GLOO_SOCKET_IFNAME": net.dev(s)})
        await watch(workers, services, counters, memory, timeout, run_dir)
    finally:
        stop([*workers.values(), *services.values()], grace=5)
    outs = [json.loads((run_dir / f"replica{i}.json").read_text()) for i in range(replicas)]
    steps = {r["step"] for out in outs for r in out["rounds"][-1:]}
    if steps != {rounds}:
        raise PlacementFailed(f"replicas ended on manager steps {sorted(steps)}, not {rounds}: commits failed")
    return outs, counters, memory


async def run_torchft(links: dict, args: argparse.Namespace, run_dir: Path, sites: int, per_site: int) -> dict:
    """One run of benchmarks/sites.py's torchft row; the same figures as a nodeox placement's."""
    from site_figures import PlacementSkipped, latest_times, per_round, run_figures

    python = args.torchft_python or Path(sys.executable)
    reason = netns_missing() or torchft_missing(python)
    if reason:
        raise PlacementSkipped(reason)
    with Namespaces(sites, links["far"].rate / 1e6) as net:
        outs, counters, memory = await run_diloco(net, python, args.model, args.rounds, args.timeout, run_dir,
                                                  per_site)
    rounds = per_round(latest_times([out["rounds"] for out in outs]), counters.both_ways)
    return {"rounds": rounds, **run_figures(rounds), "far_bytes_total": counters.total(),
            "memory": {"used_gib": (memory["start_available"] - memory["min_available"]) / 2**30,
                       "peak_rss_mib": {f"replica{i}": out["peak_rss"] / 2**20 for i, out in enumerate(outs)}},
            "delay_emulated": False}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica", action="store_true")
    p.add_argument("--serve-lighthouse", action="store_true")
    p.add_argument("--lighthouse", help="(replica) the lighthouse's URL")
    p.add_argument("--index", type=int)
    p.add_argument("--replica-id")
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--address")
    p.add_argument("--shapes")
    p.add_argument("--rounds", type=int)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--out")
    args = p.parse_args()
    if args.replica:
        replica_main(args)
    elif args.serve_lighthouse:
        lighthouse_main(args)
    else:
        p.error("run by benchmarks/sites.py or benchmarks/peers.py (--replica or --serve-lighthouse)")


if __name__ == "__main__":
    main()
