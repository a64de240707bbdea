"""The torchft row of benchmarks/sites.py: torchft's fp32 DiLoCo, 2 sites x 4 replicas, over the same far links.

torchft's replicas all-reduce among themselves (gloo), so what crosses the WAN is the traffic BETWEEN the sites:
each site is a network namespace whose one veth to a hub namespace is its far link, shaped with ``tc tbf`` to the
far rate in both directions (the site's uplink on its own end, its downlink on the hub's end). A byte from site 0
to site 1 crosses site 0's link up and site 1's link down, as it would over two sites' WAN links. The replicas of
a site share its namespace: among themselves they talk over its loopback (the near network, unshaped). The
lighthouse sits in the hub. This kernel has no netem and gloo connects straight to the addresses its peers
advertise (no proxy can stand in the way), so the far links' DELAY is not emulated for this row: its times are a
lower bound (each of the ring's 2(N-1) steps per all-reduce would add about a one-way delay per tensor).

Each replica: a module with the model's floating-point tensor shapes (seeded alike, ``init_sync=False``: no
checkpoint transfer at start, as the nodeox hosts start alike), a ``Manager`` (its own TCPStore, gloo,
``min_replica_size`` = all replicas, advertising its site's address), ``DiLoCo(sync_every=1)`` with torchft's
defaults (fp32, one all-reduce per tensor): each round a synthetic gradient, one inner SGD step, which syncs.
It writes per round the step's start (``sent``: the pseudogradient is taken and the all-reduce starts) and end
(``applied`` = ``done``: the outer step applied). Far bytes: the sites' veth counters, sampled.

Needs root, ``ip`` and ``tc``, and a Python with torch and torchft (``--torchft-python``; e.g. a venv with
``pip install torch torchft``). Run as a replica or the lighthouse by benchmarks/sites.py, not by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "nxft"  # namespace and device names: nxft-hub, nxft-s0, nxft-s1; veths nxft0 (site end), nxfth0 (hub end)
SUBNET = "10.77.0"
HUB = f"{SUBNET}.254"
LIGHTHOUSE_PORT = 29510
SAMPLE_S = 0.1


def site_ip(site: int) -> str:
    return f"{SUBNET}.{site + 1}"


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


def sh(*cmd: str) -> None:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")


class Sites:
    """The namespaces: a hub with a bridge, one namespace per site with one veth into it, both ends shaped."""

    def __init__(self, sites: int, mbit: float) -> None:
        self.sites, self.mbit = sites, mbit
        self.hub = f"{PREFIX}-hub"
        self.names = [f"{PREFIX}-s{s}" for s in range(sites)]

    def __enter__(self) -> Sites:  # noqa: PYI034
        self.remove()  # what an earlier run left behind
        try:
            sh("ip", "netns", "add", self.hub)
            sh("ip", "-n", self.hub, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            sh("ip", "-n", self.hub, "addr", "add", f"{HUB}/24", "dev", "br0")
            sh("ip", "-n", self.hub, "link", "set", "br0", "up")
            rate, burst = f"{self.mbit:g}mbit", "128kb"  # burst: above one GSO segment (64 KiB)
            for s, ns in enumerate(self.names):
                sh("ip", "netns", "add", ns)
                sh("ip", "-n", ns, "link", "set", "lo", "up")
                sh("ip", "link", "add", f"{PREFIX}{s}", "netns", ns, "type", "veth", "peer", "name",
                   f"{PREFIX}h{s}", "netns", self.hub)
                sh("ip", "-n", ns, "addr", "add", f"{site_ip(s)}/24", "dev", f"{PREFIX}{s}")
                sh("ip", "-n", ns, "link", "set", f"{PREFIX}{s}", "up")
                sh("ip", "-n", self.hub, "link", "set", f"{PREFIX}h{s}", "master", "br0", "up")
                for where, dev in ((ns, f"{PREFIX}{s}"), (self.hub, f"{PREFIX}h{s}")):  # up, down
                    sh("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                       "latency", "100ms")
        except Exception:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in (*self.names, self.hub):
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)

    def exec(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


def veth_bytes(pid: int, dev: str) -> int:
    """tx + rx bytes of ``dev`` in the network namespace of process ``pid``."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == dev:
            values = fields.split()
            return int(values[0]) + int(values[8])
    raise RuntimeError(f"no {dev} in /proc/{pid}/net/dev")


def why_not(python: Path) -> str | None:
    """Why the torchft row cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found"
    probe = subprocess.run([str(python), "-c", "import torchft"], check=False, capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return (f"torchft does not import in {python} ({last}); "
                "make a venv with `pip install torch torchft` and pass --torchft-python VENV/bin/python")
    return None


async def run_torchft(links: dict, args: argparse.Namespace, run_dir: Path, sites: int, per_site: int) -> dict:
    """One run of the torchft row; the same figures as a nodeox placement's."""
    from common import model_shapes, process_env, spawn, stop, tail
    from site_figures import (
        PlacementFailed,
        PlacementSkipped,
        check_memory,
        mem_available,
        per_round,
        run_figures,
        sent_between,
    )

    python = args.torchft_python or Path(sys.executable)
    reason = why_not(python)
    if reason:
        raise PlacementSkipped(reason)
    run_dir.mkdir(parents=True, exist_ok=True)
    shapes = run_dir / "shapes.json"
    shapes.write_text(json.dumps(model_shapes(args.model)))
    replicas = sites * per_site
    env = {k: v for k, v in process_env().items() if k != "PYTHONPATH"}  # torchft's own Python and packages
    procs: dict[str, subprocess.Popen] = {}
    memory = {"start_available": mem_available(), "min_available": mem_available()}
    with Sites(sites, links["far"].rate / 1e6) as net:
        try:
            procs["lighthouse"] = spawn([*net.exec(net.hub), str(python), __file__, "--serve-lighthouse", "--replicas",
                                         str(replicas)], run_dir / "lighthouse.log", env=env)
            keepers = [spawn([*net.exec(ns), "sleep", "infinity"], None) for ns in net.names]  # counters' window
            procs |= {f"keeper{s}": k for s, k in enumerate(keepers)}
            for s, ns in enumerate(net.names):
                for k in range(per_site):
                    i = s * per_site + k  # ids sort by site: the ring crosses between the sites twice, not 2 x 4
                    procs[f"replica{i}"] = spawn(
                        [*net.exec(ns), str(python), __file__, "--replica", "--index", str(i), "--replica-id",
                         f"s{s}r{k}", "--replicas", str(replicas), "--address", site_ip(s), "--lighthouse",
                         f"http://{HUB}:{LIGHTHOUSE_PORT}", "--shapes", str(shapes), "--rounds", str(args.rounds),
                         "--timeout", str(args.timeout), "--out", str(run_dir / f"replica{i}.json")],
                        run_dir / f"replica{i}.log", env={**env, "GLOO_SOCKET_IFNAME": f"{PREFIX}{s}"})
            timelines: list[list[tuple[float, int]]] = [[] for _ in range(sites)]
            workers = [p for name, p in procs.items() if name.startswith("replica")]
            deadline = time.monotonic() + args.timeout
            while any(p.poll() is None for p in workers):
                if any(p.returncode not in (None, 0) for p in workers) or procs["lighthouse"].poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise PlacementFailed(f"the torchft run did not finish within {args.timeout:.0f} s")
                now = time.time()
                check_memory(memory)
                for s, keeper in enumerate(keepers):
                    timelines[s].append((now, veth_bytes(keeper.pid, f"{PREFIX}{s}")))
                await asyncio.sleep(SAMPLE_S)
            failed = [f"{name} (status {p.returncode})" for name, p in procs.items()
                      if name.startswith("replica") and p.returncode]
            if failed or procs["lighthouse"].poll() is not None:
                raise PlacementFailed(f"{', '.join(failed) or 'the lighthouse'} failed:\n" + "\n".join(
                    f"--- {f.name} ---\n{tail(f)}" for f in sorted(run_dir.glob("*.log"))))
        finally:
            stop(list(procs.values()), grace=5)
    outs = [json.loads((run_dir / f"replica{i}.json").read_text()) for i in range(replicas)]
    last: dict[tuple[int, str], float] = {}
    for out in outs:
        for r in out["rounds"]:
            for what in ("sent", "applied", "done"):
                last[(r["round"], what)] = max(last.get((r["round"], what), float("-inf")), r[what])
    steps = {r["step"] for out in outs for r in out["rounds"][-1:]}
    if steps != {args.rounds}:
        raise PlacementFailed(f"replicas ended on manager steps {sorted(steps)}, not {args.rounds}: commits failed")

    def far_sent_between(start: float, end: float) -> int:
        return sum(sent_between(t, start, end) for t in timelines)

    rounds = per_round(last, far_sent_between)
    return {"rounds": rounds, **run_figures(rounds),
            "far_bytes_total": sum(t[-1][1] - t[0][1] for t in timelines if t),
            "memory": {"used_gib": (memory["start_available"] - memory["min_available"]) / 2**30, "peak_rss_mib": {f"replica{i}": out["peak_rss"] / 2**20 for i, out in enumerate(outs)}},
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
        p.error("run by benchmarks/sites.py (--replica or --lighthouse)")


if __name__ == "__main__":
    main()
