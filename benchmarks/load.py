"""One coordinator under many hosts, straight or behind site relays: a small model (~100k parameters), 20 rounds.

Each host is a process running the real exchange (HostRound: encode, upload, wait, download, apply, verify) with
its heartbeat and telemetry, and no Lightning; "training" nudges the tensors. Hosts are forked from one process
that has imported torch, so they share its pages (64 hosts fit in a few GiB). Placements:

    flat    every host straight to the coordinator (the root)
    relays  the hosts spread over ``--relays`` site relays (`nodeox relay`, consecutive blocks as
            `nodeox launch --sites` spreads them), the relays under the root

Printed per placement and host count: that every round completed with every host (and every site), the root's
aggregation-to-sync (its aggregation end to the last download start of the hosts it aggregated, median and max
over rounds), with relays also each site's (the relay's own aggregation end to its hosts' last download start:
it spans the relay's exchange upstream), the root's CPU seconds per round (from the CPU time it records with every
memory sample), and the RSS of the root and of every relay after round 3 and after the last round, with the
largest deviation from round 3's of any round between; then the goals, MET or MISSED: every process's RSS within
5% of round 3's from round 3 to the last round; with both placements, the root's CPU per round behind relays at
most 1/4 of flat's at the same host count.

    python benchmarks/load.py [--placements flat] [--hosts 4,8,16,32] [--relays 8] [--rounds 20] [--json]
    python benchmarks/load.py --placements flat,relays --hosts 64        # issue 17: 64 hosts, flat against 8 relays
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import coordinator_command, read_events, relay_command, spawn, stop, tail, wait_ready

from lightning_nodeox.tools.topology import spread

SHAPES = [("w1", (256, 256)), ("w2", (128, 256)), ("b1", (256,)), ("b2", (128,)), ("scale", (1312,))]  # 100k
PLACEMENTS = ("flat", "relays")
GOAL_RSS_DRIFT = 0.05  # every process's RSS from round 3 on, against round 3's
GOAL_ROOT_CPU_RATIO = 0.25  # the root's CPU per round behind relays against flat's
FIRST_RSS_ROUND = 3


def host_main(host: str, url: str, rounds: int) -> None:
    """One host (in a forked child): join, then ``rounds`` exchanges, then leave."""
    import torch

    from lightning_nodeox.core.phases import PhaseLog
    from lightning_nodeox.host.client import HttpClient
    from lightning_nodeox.host.clock import ClockOffset
    from lightning_nodeox.host.heartbeat import Heartbeat
    from lightning_nodeox.host.round import HostRound
    from lightning_nodeox.host.telemetry import TelemetryShipper
    from lightning_nodeox.host.tensors import HostTensors

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)  # every host starts from the same model: no fetch at join
    named = [(n, torch.empty(s).uniform_(-0.05, 0.05, generator=gen)) for n, s in SHAPES]
    clock = ClockOffset()
    client = HttpClient(url, host=host, clock=clock, retry_for=300, read_timeout=300)
    beat = Heartbeat(client)
    phases = PhaseLog(host)
    shipper = TelemetryShipper(client, clock)
    phases.listeners.append(shipper)
    exchange = HostRound(HostTensors(named), client, phases, codec_threads=1)
    exchange.join()
    for r in range(rounds):
        with torch.no_grad():
            for i, (_, t) in enumerate(named):
                t.mul_(1.0 + 1e-4 * (int(host) % 7 + 1)).add_(1e-5 * (i % 3))
        exchange.run_round(samples=32, final=r == rounds - 1)
    beat.stop()
    shipper.close()
    client.leave()


def fork_host(host: str, url: str, rounds: int) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        host_main(host, url, rounds)
    except BaseException:  # noqa: BLE001 - report and exit the child, never return into the parent's code
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


SERVING = ("--threads", "1", "--rss-interval", "3600", "--snapshot-every", "1000")  # memory sampled as rounds close
COORDINATOR = "coordinator"  # the host of a coordinator's (or a relay's) own records


def run(placement: str, hosts: int, relays: int, rounds: int, workdir: Path) -> dict:
    """One run of ``placement`` (flat or relays) under ``hosts`` forked hosts; its figures (see :func:`summarize`)."""
    top = workdir / f"{placement}{hosts}"
    top.mkdir(parents=True)
    relayed = placement == "relays"
    blocks = spread(hosts, relays) if relayed else [list(range(hosts))]
    names = ["root", *(f"site{k}" for k in range(len(blocks)) if relayed)]  # a relay's id upstream: its dir's name
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # OpenMP threads as the servers set them
    servers = [spawn(coordinator_command(len(blocks) if relayed else hosts, top / "root", top / "root.url", *SERVING),
                     top / "root.log", env=env)]
    pids: list[int] = []
    try:
        root_url = wait_ready(top / "root.url", servers[0], top / "root.log")
        for k, name in enumerate(names[1:]):
            servers.append(spawn(relay_command(root_url, len(blocks[k]), top / name, top / f"{name}.url", *SERVING),
                                 top / f"{name}.log", env=env))
        urls = [wait_ready(top / f"{n}.url", s, top / f"{n}.log") for n, s in zip(names[1:], servers[1:])] or [root_url]
        started = time.time()
        pids = [fork_host(str(i), urls[k], rounds) for k, block in enumerate(blocks) for i in block]
        failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
        pids = []
        wall = time.time() - started
        codes = [s.wait(120) for s in servers[1:] + servers[:1]]  # relays end once the run is complete, then the root
        if failed or any(codes):
            logs = "\n".join(f"{n}.log:\n{tail(top / f'{n}.log', 20)}" for n in names)
            raise RuntimeError(f"{len(failed)} hosts failed; exit statuses (relays, root) {codes}:\n{logs}")
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        stop(servers)
    sites = [read_events(top / n) for n in names[1:]]
    return {"placement": placement, "hosts": hosts, "relays": len(sites), "rounds": rounds, "wall_s": wall,
            **summarize(read_events(top / "root"), sites, blocks, rounds)}


# -- figures from a run's records (the root's events.jsonl, and each relay's own) ------------------------------------


def own_records(events: list[dict]) -> list[dict]:
    """A coordinator's records less what relays forwarded (``RELAY/HOST``): its own and its direct hosts'."""
    return [e for e in events if "/" not in str(e.get("host", ""))]


def aggregation_to_sync(events: list[dict], rounds: int) -> list[float]:
    """Per round 1 .. ``rounds`` - 1 (round 0 holds the start-up): seconds from the coordinator's
    aggregation end to the last download start of the hosts that aggregation took (a relay's own log: its hosts)."""
    events = own_records(events)
    aggregate = {e["round"]: e for e in events if e["phase"] == "aggregate" and e["host"] == COORDINATOR}
    downloads: dict[int, list[float]] = {}
    for e in events:
        if e["phase"] == "download" and e["round"] in aggregate and e["host"] in aggregate[e["round"]]["hosts"]:
            downloads.setdefault(e["round"], []).append(e["start"])
    return [max(downloads[r]) - aggregate[r]["end"] for r in range(1, rounds) if r in downloads]


def memory_samples(events: list[dict]) -> dict[int, dict]:
    """The coordinator's own memory samples by the round they are tagged with: sampled as each round closes,
    tagged with the round that opens, so sample r is after r rounds (the last of a round wins)."""
    return {e["round"]: e for e in own_records(events) if e["phase"] == "rss" and e["host"] == COORDINATOR
            and e["round"] >= 1}


def cpu_per_round(samples: dict[int, dict], rounds: int) -> float:
    """Median CPU seconds of the coordinator's rounds 3 .. ``rounds`` (between consecutive samples)."""
    cpu = [samples[r + 1]["cpu_s"] - samples[r]["cpu_s"] for r in range(2, rounds) if r + 1 in samples and r in samples]
    return statistics.median(cpu)


def rss_figures(samples: dict[int, dict], rounds: int, first: int = FIRST_RSS_ROUND) -> dict:
    """RSS after round ``first`` and after the last, and the largest deviation from round ``first``'s of any
    sample from there to the last (signed, the larger in size); ``met``: within :data:`GOAL_RSS_DRIFT`."""
    base = samples[first]["rss_bytes"]
    deviations = [samples[r]["rss_bytes"] / base - 1 for r in range(first, rounds + 1) if r in samples]
    worst = max(deviations, key=abs)
    return {f"rss_after_round_{first}": base, "rss_after_last_round": samples[rounds]["rss_bytes"],
            "rss_max_deviation": worst, "rss_met": abs(worst) <= GOAL_RSS_DRIFT}


def summarize(root: list[dict], sites: list[list[dict]], blocks: list[list[int]], rounds: int) -> dict:
    """The figures of one run: ``root``: the root's events, ``sites``: each relay's own (none when flat),
    ``blocks``: each site's host ids (one block when flat)."""
    aggregates = [{e["round"]: e for e in own_records(events) if e["phase"] == "aggregate"
                   and e["host"] == COORDINATOR} for events in [root, *sites]]
    expected = [len(sites) or len(blocks[0]), *(len(b) for b in blocks[: len(sites)])]
    complete = [r for r in range(rounds) if all(len(a.get(r, {}).get("hosts", ())) == n
                                                for a, n in zip(aggregates, expected))]
    to_sync = aggregation_to_sync(root, rounds)
    root_samples = memory_samples(root)
    out = {
        "rounds_complete_with_every_host": len(complete),
        "aggregation_to_sync_median_s": statistics.median(to_sync),
        "aggregation_to_sync_max_s": max(to_sync),
        "coordinator_cpu_s_per_round": cpu_per_round(root_samples, rounds),
        **{f"coordinator_{k}": v for k, v in rss_figures(root_samples, rounds).items()},
    }
    if sites:
        site_sync = [aggregation_to_sync(events, rounds) for events in sites]
        every = [s for per in site_sync for s in per]
        out.update(site_aggregation_to_sync_median_s=statistics.median(every),
                   site_aggregation_to_sync_max_s=max(every), relays_detail=[])
        for k, events in enumerate(sites):
            samples = memory_samples(events)
            out["relays_detail"].append({"relay": f"site{k}", "hosts": len(blocks[k]),
                                         "aggregation_to_sync_median_s": statistics.median(site_sync[k]),
                                         "cpu_s_per_round": cpu_per_round(samples, rounds),
                                         **rss_figures(samples, rounds)})
    return out


def goals(results: list[dict]) -> list[dict]:
    """The goals, each with ``met`` and what was measured: RSS of every process within 5% from round 3 to the
    last; the root's CPU per round behind relays at most 1/4 of flat's, per host count that ran both."""
    out = []
    for r in results:
        procs = [("root", r["coordinator_rss_met"], r["coordinator_rss_max_deviation"])]
        procs += [(d["relay"], d["rss_met"], d["rss_max_deviation"]) for d in r.get("relays_detail", [])]
        out.append({"goal": f"{r['placement']} {r['hosts']} hosts: every round completes with every host; RSS of "
                            f"root{' and relays' if len(procs) > 1 else ''} within {GOAL_RSS_DRIFT:.0%} of round "
                            f"{FIRST_RSS_ROUND}'s through round {r['rounds']}",
                    "met": r["rounds_complete_with_every_host"] == r["rounds"] and all(m for _, m, _ in procs),
                    "measured": f"{r['rounds_complete_with_every_host']}/{r['rounds']} rounds complete; "
                                + ", ".join(f"{name} {dev:+.1%} {'met' if m else 'MISSED'}" for name, m, dev in procs)})
    flat = {r["hosts"]: r for r in results if r["placement"] == "flat"}
    for r in results:
        if r["placement"] == "relays" and r["hosts"] in flat:
            base = flat[r["hosts"]]["coordinator_cpu_s_per_round"]
            ratio = r["coordinator_cpu_s_per_round"] / base if base > 0 else float("inf")
            out.append({"goal": f"{r['hosts']} hosts: root CPU per round behind {r['relays']} relays at most "
                                f"{GOAL_ROOT_CPU_RATIO:g} of flat's",
                        "met": ratio <= GOAL_ROOT_CPU_RATIO,
                        "measured": f"{r['coordinator_cpu_s_per_round']:.3f} s against {base:.3f} s: {ratio:.2f}x"})
    return out


def print_table(results: list[dict], rounds: int) -> None:
    last = f"RSS r{rounds} MiB"
    print(f"\n{'placement':>9} {'hosts':>5} {'rounds ok':>9} {'wall s':>7} {'agg->sync root med/max s':>25} "
          f"{'site med/max s':>16} {'root CPU s/round':>17} {'RSS r3 MiB':>11} {last:>12} {'max dev':>8}")
    for r in results:
        site = (f"{r['site_aggregation_to_sync_median_s']:.3f} / {r['site_aggregation_to_sync_max_s']:<.3f}"
                if r["relays"] else "-")
        print(f"{r['placement']:>9} {r['hosts']:>5} {r['rounds_complete_with_every_host']:>6}/{r['rounds']:<2} "
              f"{r['wall_s']:>7.1f} {r['aggregation_to_sync_median_s']:>15.3f} / "
              f"{r['aggregation_to_sync_max_s']:<7.3f} "
              f"{site:>16} {r['coordinator_cpu_s_per_round']:>17.3f} "
              f"{r[f'coordinator_rss_after_round_{FIRST_RSS_ROUND}'] / 2**20:>11.0f} "
              f"{r['coordinator_rss_after_last_round'] / 2**20:>12.0f} {r['coordinator_rss_max_deviation']:>+8.1%}")
        for d in r.get("relays_detail", []):
            print(f"{'':>9} {'':>5}   relay {d['relay']:<6} ({d['hosts']} hosts) agg->sync median "
                  f"{d['aggregation_to_sync_median_s']:.3f} s, CPU {d['cpu_s_per_round']:.3f} s/round, RSS "
                  f"{d[f'rss_after_round_{FIRST_RSS_ROUND}'] / 2**20:.0f} -> {d['rss_after_last_round'] / 2**20:.0f}"
                  f" MiB, max dev {d['rss_max_deviation']:+.1%} {'met' if d['rss_met'] else 'MISSED'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placements", default="flat", help=f"comma-separated, of {','.join(PLACEMENTS)}")
    p.add_argument("--hosts", default="4,8,16,32", help="comma-separated host counts (each placement runs each)")
    p.add_argument("--relays", type=int, default=8, help="site relays of the relays placement")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", type=Path, help="keep every run's directory (records, logs) under this new folder")
    args = p.parse_args()
    placements = [s.strip() for s in args.placements.split(",") if s.strip()]
    if not placements or any(s not in PLACEMENTS for s in placements):
        p.error(f"--placements {args.placements}: choose from {','.join(PLACEMENTS)}")
    counts = [int(h) for h in args.hosts.split(",")]
    if "relays" in placements and min(counts) < args.relays:
        p.error(f"--relays {args.relays} is more than --hosts {min(counts)}: every relay needs a host")
    if args.rounds < FIRST_RSS_ROUND + 1:
        p.error(f"--rounds must be at least {FIRST_RSS_ROUND + 1}: RSS is compared from round {FIRST_RSS_ROUND} on")
    import torch  # before forking: the hosts share the parent's pages

    import lightning_nodeox.host.round  # noqa: F401 - imported once here for the forked hosts

    torch.set_num_threads(1)
    results = []
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="nodeox-load-")
    try:
        for n in counts:
            for placement in placements:
                results.append(run(placement, n, args.relays, args.rounds, args.keep or Path(tmp.name)))
                print(f"{placement} {n} hosts done in {results[-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    finally:
        if tmp is not None:
            tmp.cleanup()
    result_goals = goals(results)
    if args.json:
        print(json.dumps({"results": results, "goals": result_goals}, indent=2))
        return
    print_table(results, args.rounds)
    print()
    for g in result_goals:
        print(f"{'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']}")


if __name__ == "__main__":
    main()
