"""One coordinator under many hosts: 4, 8, 16 and 32 host processes, a small model (~100k parameters), 20 rounds.

Each host is a process running the real exchange (HostRound: encode, upload, wait, download, apply, verify) with
its heartbeat and telemetry, and no Lightning; "training" nudges the tensors. Hosts are forked from one process
that has imported torch, so they share its pages (32 hosts fit in a few GiB). Printed per host count: that every
round completed with every host, aggregation-to-sync (aggregation end to the last host's download start, median
over rounds), the coordinator's CPU seconds per round (from the CPU time it records with every memory sample),
and its RSS after round 3 and after the last round (flat: within 5%).

    python benchmarks/load.py [--hosts 4,8,16,32] [--rounds 20] [--json]
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

from common import coordinator_command, read_events, spawn, stop, tail, wait_ready

SHAPES = [("w1", (256, 256)), ("w2", (128, 256)), ("b1", (256,)), ("b2", (128,)), ("scale", (1312,))]  # 100k
GOAL_RSS_DRIFT = 0.05


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


def run(hosts: int, rounds: int, workdir: Path) -> dict:
    run_dir = workdir / f"hosts{hosts}"
    run_dir.mkdir(parents=True)
    ready, log = run_dir / "ready", run_dir / "coordinator.log"
    coordinator = spawn(coordinator_command(hosts, run_dir, ready, "--threads", "1", "--rss-interval", "3600",
                                            "--snapshot-every", "1000"), log,
                        env=dict(os.environ, PYTHONUNBUFFERED="1"))  # OpenMP threads as the coordinator sets them
    pids: list[int] = []
    try:
        url = wait_ready(ready, coordinator, log)
        started = time.time()
        pids = [fork_host(str(i), url, rounds) for i in range(hosts)]
        failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
        pids = []
        wall = time.time() - started
        if failed or coordinator.wait(120) != 0:
            raise RuntimeError(f"{len(failed)} hosts failed; coordinator: {tail(log, 40)}")
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        stop([coordinator])
    return {"hosts": hosts, "rounds": rounds, "wall_s": wall, **summarize(read_events(run_dir), hosts, rounds)}


def summarize(events: list[dict], hosts: int, rounds: int) -> dict:
    aggregate = {e["round"]: e for e in events if e["phase"] == "aggregate"}
    downloads: dict[int, list[float]] = {}
    for e in events:
        if e["phase"] == "download":
            downloads.setdefault(e["round"], []).append(e["start"])
    complete = sorted(r for r, e in aggregate.items() if len(e["hosts"]) == hosts)
    to_sync = [max(downloads[r]) - aggregate[r]["end"] for r in range(1, rounds) if r in downloads]
    # the coordinator samples memory and CPU time as each round closes (tagged with the round that opens)
    samples = {e["round"]: e for e in events if e["phase"] == "rss" and e["round"] >= 1}
    cpu = [samples[r + 1]["cpu_s"] - samples[r]["cpu_s"] for r in range(2, rounds) if r + 1 in samples and r in samples]
    rss3, rss_last = samples[3]["rss_bytes"], samples[rounds]["rss_bytes"]
    return {
        "rounds_complete_with_every_host": len(complete),
        "aggregation_to_sync_median_s": statistics.median(to_sync),
        "aggregation_to_sync_max_s": max(to_sync),
        "coordinator_cpu_s_per_round": statistics.median(cpu),
        "coordinator_rss_after_round_3": rss3,
        f"coordinator_rss_after_round_{rounds}": rss_last,
        "rss_drift": rss_last / rss3 - 1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="4,8,16,32")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    import torch  # before forking: the hosts share the parent's pages

    import lightning_nodeox.host.round  # noqa: F401 - imported once here for the forked hosts

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="nodeox-load-") as tmp:
        for n in (int(h) for h in args.hosts.split(",")):
            results.append(run(n, args.rounds, Path(tmp)))
            if not args.json:
                r = results[-1]
                print(f"{n} hosts done in {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    last = f"coordinator_rss_after_round_{args.rounds}"
    print(f"\n{'hosts':>5} {'rounds ok':>9} {'wall s':>7} {'agg->sync median/max s':>23} {'coord CPU s/round':>18} "
          f"{'RSS r3 MiB':>11} {f'RSS r{args.rounds} MiB':>12} {'drift':>7}")
    for r in results:
        print(f"{r['hosts']:>5} {r['rounds_complete_with_every_host']:>6}/{r['rounds']:<2} {r['wall_s']:>7.1f} "
              f"{r['aggregation_to_sync_median_s']:>13.3f} / {r['aggregation_to_sync_max_s']:<7.3f} "
              f"{r['coordinator_cpu_s_per_round']:>18.3f} {r['coordinator_rss_after_round_3'] / 2**20:>11.0f} "
              f"{r[last] / 2**20:>12.0f} {r['rss_drift']:>+7.1%}")
    ok = all(r["rounds_complete_with_every_host"] == r["rounds"] and abs(r["rss_drift"]) <= GOAL_RSS_DRIFT
             for r in results)
    print(f"\n{'MET   ' if ok else 'MISSED'} every round completes with every host; coordinator RSS after the last "
          f"round within {GOAL_RSS_DRIFT:.0%} of round 3")


if __name__ == "__main__":
    main()
