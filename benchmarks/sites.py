"""Placement with sites: 2 sites x 4 hosts at ViT-B size, flat against a relay per site (and torchft's DiLoCo).

Every host has a near link to its site (1 ms one-way, 10 Gbit/s, its own); every site has ONE far link to the
root (30 ms, 200 Mbit/s each way), shared by whatever crosses it. Links are the user-space emulator of
benchmarks/relay.py (this kernel has no netem): one emulator per link, so a far link's token bucket is shared by
every connection through it. Placements, run side by side (interleaved, ``--repeats`` times each):

- flat: a root ``nodeox coordinator`` for 8 hosts; each host -> its near link -> its site's far link -> root
  (the 4 hosts of a site share the site's 200 Mbit/s).
- relays: the root for 2 hosts (the relays); per site a ``nodeox relay --hosts 4`` whose upstream is the site's
  far link; each host -> its near link -> its site's relay.
- torchft: torchft's fp32 DiLoCo over the same far links (benchmarks/sites_torchft.py), when torchft is
  installed (``--torchft-python``); otherwise the row says why it is skipped.

Hosts are the synthetic ones of benchmarks/exchange.py (``--host``: the model's real tensor shapes, a real
exchange each round, no training). Per round (round 0, with the model's first upload, is left out):

- far bytes: what the far links' emulators delivered, both directions, both sites, between the last host's
  sync of the round before and of this round (not the run's records: HTTP framing, heartbeats, records included);
- delta to sync: the last host's delta sent (its upload end) to the last host's sync applied (its apply end);
- round: the last host's sync applied (verify end) in the round before to the same in this round.

Rounds of different sites overlap (a site done early sends its next delta before the other site's last host is
done): those bytes count in the window they crossed in, so a single round can read low or high; medians even it.

Each run is appended to a JSON-lines file as it ends (``--results``); a run that fails is recorded there with its
reason and the next one runs. Printed per placement: the median over rounds of each run, then over runs, with the
range over runs; the goals beside them, met or not. Memory: the lowest MemAvailable seen while a placement ran,
and each process's peak.

    python benchmarks/sites.py [--json] [--rounds 4] [--repeats 2] [--model vit_base_patch16_224]
        [--placements flat,relays,torchft] [--torchft-python PY] [--far-delay-ms 30] [--far-mbit 200]
        [--near-delay-ms 1] [--near-mbit 10000] [--run-dir DIR] [--timeout 1200]
        [--results FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

from common import (
    SampleLog,
    add_results_option,
    beside,
    coordinator_command,
    failure_lines,
    interleaved,
    process_env,
    read_events,
    run_async,
    spawn,
    stop,
    tail,
    wait_ready,
)
from relay import Link, Relay, add_link_options, links_of
from site_figures import (
    HOSTS_PER_SITE,
    METRICS,
    SITES,
    PlacementFailed,
    check_memory,
    goals,
    mem_available,
    nodeox_times,
    per_round,
    placement_figures,
    root_payload,
    run_figures,
    sent_between,
)

EXCHANGE = Path(__file__).with_name("exchange.py")


# -- one nodeox placement -----------------------------------------------------------------------------------------


async def exited(procs: list[subprocess.Popen], memory: dict) -> None:
    """Until every process has ended (or one failed); the links run on this loop meanwhile."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            return
        check_memory(memory)
        await asyncio.sleep(0.2)


def peak_rss_mib(log: Path) -> float | None:
    """The peak RSS a coordinator or relay printed at its end."""
    found = re.findall(r"peak RSS (\d+) MiB", tail(log, 30))
    return float(found[-1]) if found else None


def host_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [sys.executable, str(EXCHANGE), "--host", "--model", args.model, "--rounds", str(args.rounds),
            "--out", str(out)]


async def run_nodeox(placement: str, links: dict[str, Link], args: argparse.Namespace, run_dir: Path) -> dict:
    """One run of ``placement`` ("flat" or "relays"); returns its rounds, memory and byte totals."""
    out, logs = beside(run_dir, "out"), beside(run_dir, "logs")
    for d in (run_dir, out, logs):
        d.mkdir(parents=True, exist_ok=True)
    for stale in ("ready", "events.jsonl"):
        (run_dir / stale).unlink(missing_ok=True)
    procs: dict[str, subprocess.Popen] = {}
    far: list[Relay] = []
    near: list[Relay] = []
    memory = {"start_available": mem_available(), "min_available": mem_available()}
    try:
        ready, log = run_dir / "ready", logs / "coordinator.log"
        root_hosts = SITES * HOSTS_PER_SITE if placement == "flat" else SITES
        procs["coordinator"] = spawn(coordinator_command(root_hosts, run_dir, ready, "--threads", "1"), log)
        try:
            root = urlsplit(wait_ready(ready, procs["coordinator"], log))
        except RuntimeError:
            raise PlacementFailed(f"the coordinator did not start:\n{tail(log)}") from None
        for site in range(SITES):
            far.append(link := Relay(root.hostname, root.port, up=links["far"], down=links["far"]))
            site_port = await link.start()
            if placement == "relays":
                site_dir = beside(run_dir, f"site{site}")
                site_dir.mkdir(parents=True, exist_ok=True)
                (site_dir / "ready").unlink(missing_ok=True)
                name, site_log = f"relay{site}", logs / f"relay{site}.log"
                procs[name] = spawn([sys.executable, "-m", "lightning_nodeox", "relay", "--upstream",
                                     f"http://127.0.0.1:{site_port}", "--hosts", str(HOSTS_PER_SITE), "--run-dir",
                                     str(site_dir), "--id", f"site{site}", "--bind", "127.0.0.1:0", "--ready-file",
                                     str(site_dir / "ready"), "--threads", "1"], site_log)
                try:
                    # in a thread: the far link it reaches the root through runs on this loop
                    site_port = urlsplit(await asyncio.to_thread(
                        wait_ready, site_dir / "ready", procs[name], site_log)).port
                except RuntimeError:
                    raise PlacementFailed(f"relay {site} did not start:\n{tail(site_log)}") from None
            for k in range(HOSTS_PER_SITE):
                host = site * HOSTS_PER_SITE + k
                near.append(hop := Relay("127.0.0.1", site_port, up=links["near"], down=links["near"]))
                port = await hop.start()
                procs[f"host{host}"] = spawn(host_command(args, out), logs / f"host{host}.log", env=process_env(
                    NODEOX_HOST_ID=str(host), NODEOX_COORDINATOR_URL=f"http://127.0.0.1:{port}"))
        try:
            await asyncio.wait_for(exited(list(procs.values()), memory), args.timeout)
        except asyncio.TimeoutError:
            raise PlacementFailed(f"the run did not finish within {args.timeout:.0f} s") from None
        failed = [f"{name} (status {p.returncode})" for name, p in procs.items() if p.returncode]
        if failed:
            raise PlacementFailed(f"{', '.join(failed)} failed:\n" + "\n".join(
                f"--- {f.name} ---\n{tail(f)}" for f in sorted(logs.glob("*.log"))))
    finally:
        stop(list(procs.values()), grace=10)
        for link in (*near, *far):
            await link.close()

    def far_sent_between(start: float, end: float) -> int:
        return sum(sent_between(d.timeline, start, end) for link in far for d in (link.up, link.down))

    records = read_events(run_dir)
    rounds = per_round(nodeox_times(records), far_sent_between)
    payload = root_payload(records)
    for rnd in rounds:
        rnd["payload_bytes"] = payload.get(rnd["round"], 0)
    peaks = {name: peak_rss_mib(logs / f"{name}.log") for name in procs if not name.startswith("host")}
    for name in procs:
        if name.startswith("host"):
            info = out / f"{name}.json"
            peaks[name] = json.loads(info.read_text())["peak_rss"] / 2**20 if info.exists() else None
    return {"rounds": rounds, **run_figures(rounds),
            "far_bytes_total": sum(link.up.sent + link.down.sent for link in far),
            "memory": {"used_gib": (memory["start_available"] - memory["min_available"]) / 2**30,
                       "peak_rss_mib": peaks}}


# -- all placements -------------------------------------------------------------------------------------------------


async def run_one(placement: str, links: dict[str, Link], args: argparse.Namespace, run_dir: Path) -> dict:
    if placement == "torchft":
        from sites_torchft import run_torchft  # its own module: namespaces, tc and a replica process

        return await run_torchft(links, args, run_dir, SITES, HOSTS_PER_SITE)
    return await run_nodeox(placement, links, args, run_dir)


async def run_all(args: argparse.Namespace, links: dict[str, Link], workdir: Path) -> dict:
    skipped: dict[str, str] = {}
    log = SampleLog("sites", args.results)
    runs = await interleaved(args.placements, args.repeats,
                             lambda placement, rep: run_one(placement, links, args, workdir / f"{placement}-{rep}"),
                             skipped, "sites", METRICS, log)
    figures = {p: placement_figures(r) for p, r in runs.items() if r and p not in skipped}
    return {"model": args.model, "sites": SITES, "hosts_per_site": HOSTS_PER_SITE, "rounds": args.rounds,
            "repeats": args.repeats,
            "links": {name: {"delay_ms": v.delay * 1e3, "mbit": v.rate / 1e6} for name, v in links.items()},
            "figures": figures, "goals": goals(figures), "skipped": skipped, "failed": log.failures,
            "results": str(log.path), "runs": runs}


def render(result: dict) -> str:
    links = result["links"]
    lines = [(f"{result['model']}: {result['sites']} sites x {result['hosts_per_site']} hosts, {result['rounds']} "
              f"rounds (round 0 left out), {result['repeats']} run(s) per placement, interleaved"),
             (f"  near link per host: {links['near']['delay_ms']:g} ms one-way, {links['near']['mbit']:g} Mbit/s "
              "each way (the user-space emulator caps it near 1-2 Gbit/s)"),
             (f"  far link per site:  {links['far']['delay_ms']:g} ms one-way, {links['far']['mbit']:g} Mbit/s "
              "each way, shared by the site's hosts (flat) or used by its relay"),
             "  figures: median over runs of each run's median over rounds [range over runs]", ""]
    lines.append(f"  {'placement':10} {'far MB/round (both ways)':>30} {'delta-to-sync s':>24} {'round s':>24} "
                 f"{'mem used GiB':>13}")

    def cell(s: dict, scale: float = 1.0) -> str:
        return f"{s['median'] / scale:.2f} [{s['min'] / scale:.2f}-{s['max'] / scale:.2f}]"

    for placement, fig in result["figures"].items():
        mem = max(run["memory"]["used_gib"] for run in result["runs"][placement])
        lines.append(f"  {placement:10} {cell(fig['far_bytes'], 1e6):>30} {cell(fig['delta_to_sync_s']):>24} "
                     f"{cell(fig['round_s']):>24} {mem:>13.1f}")
    for placement, reason in result["skipped"].items():
        lines.append(f"  {placement:10} skipped: {reason}")
    lines += failure_lines(result["failed"], result["results"])
    if "torchft" in result["figures"]:
        lines.append("  torchft: far links' bandwidth by tc tbf, their delay NOT emulated (no netem here, and gloo "
                     "connects straight to its peers): its times are a lower bound")
    bodies = {p: [r for run in runs for r in run["rounds"]] for p, runs in result["runs"].items()}
    bodies = {p: rounds for p, rounds in bodies.items() if rounds and all("payload_bytes" in r for r in rounds)}
    if bodies:
        lines.append("  of the far bytes per round (median), delta and sync bodies / the rest (HTTP, heartbeats, "
                     "records): " + ", ".join(
                         f"{p} {statistics.median(r['payload_bytes'] for r in rounds) / 1e6:.2f} / "
                         f"{statistics.median(r['far_bytes'] - r['payload_bytes'] for r in rounds) / 1e6:.3f} MB"
                         for p, rounds in bodies.items()))
    lines += ["", "goals:"]
    for g in result["goals"]:
        lines.append(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.4f}x")
    if not result["goals"]:
        lines.append("  none measured (a placement they compare did not run)")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--placements", default="flat,relays,torchft")
    p.add_argument("--torchft-python", type=Path,
                   help="a Python with torch and torchft (default: this one, if it imports torchft)")
    add_link_options(p)
    p.add_argument("--run-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds each run may take")
    add_results_option(p)
    args = p.parse_args()
    args.placements = args.placements.split(",")
    unknown = set(args.placements) - {"flat", "relays", "torchft"}
    if unknown:
        p.error(f"unknown placement(s) {', '.join(sorted(unknown))}: choose from flat, relays, torchft")
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 0 is left out)")
    links = links_of(args)
    result = run_async(lambda workdir: run_all(args, links, workdir), args.run_dir, "sites")
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
