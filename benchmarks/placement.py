"""A far coordinator, emulated: the exchange at ViT-B size with the coordinator near, then far.

Starts a `nodeox coordinator` and 2 synthetic hosts (the `--host` mode of benchmarks/exchange.py: real
exchanges of a model with the real model's shapes, no training), each host talking to the coordinator through
its own relay (benchmarks/relay.py) that emulates its link in both directions: near (1 ms one-way,
10 Gbit/s), then far (30 ms, 200 Mbit/s). This kernel has no netem, so the links are emulated in user space;
the relay, with the HTTP stacks at both ends, moves one to two Gbit/s here, which caps the near link.

Prints per phase the median over rounds (round 0, which pays for first-touch allocations, left out) of the
slowest host, near / far / far-near, and which phases moved with distance (far at least twice near). Besides
the phases: aggregation-to-sync (aggregate end to a host's download start) and its part after sync_prepare,
sync-ready-to-download (the sync's way to the host). A placement that cannot run is reported and skipped.

    python benchmarks/placement.py [--json] [--rounds 3] [--model vit_base_patch16_224] [--far-delay-ms 30]
        [--far-mbit 200] [--near-delay-ms 1] [--near-mbit 10000] [--run-dir DIR] [--timeout 900]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from common import beside, coordinator_command, process_env, read_events, run_async, spawn, stop, wait_ready
from relay import Link, Relay, add_link_options, links_of

EXCHANGE = Path(__file__).with_name("exchange.py")
HOSTS = 2
HOST_PHASES = ("encode", "upload", "wait", "download", "apply", "verify")
COORDINATOR_PHASES = ("aggregate", "sync_prepare")
ROWS = (*HOST_PHASES, *COORDINATOR_PHASES, "aggregation_to_sync", "sync_ready_to_download")
# a phase "moved" with distance when far is at least this many times near and later by more than half the added
# one-way delay: compute phases wander by tens of percent on a small shared machine, the link-bound ones grow more
MOVED_FACTOR = 2.0


class PlacementFailed(RuntimeError):
    """A placement could not run; the message says which part and why."""


def report_build() -> Callable[[list[dict]], dict]:
    """`build(records)` of `nodeox report`, imported only when a run is read."""
    from lightning_nodeox.tools.report import build

    return build


# -- one placement --------------------------------------------------------------------------------------------------


async def exited(procs: list[subprocess.Popen]) -> None:
    while any(p.poll() is None for p in procs):
        await asyncio.sleep(0.1)  # the relays run on this loop meanwhile


async def run_placement(link: Link, args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """One run of ``args.rounds`` rounds with every host behind its own ``link``; returns its events."""
    out, logs = beside(run_dir, "out"), beside(run_dir, "logs")
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    for stale in ("ready", "events.jsonl"):  # from an earlier run in the same --run-dir (events are appended)
        (run_dir / stale).unlink(missing_ok=True)
    procs: list[subprocess.Popen] = []
    relays: list[Relay] = []
    try:
        ready, log = run_dir / "ready", logs / "coordinator.log"
        coordinator = spawn(coordinator_command(HOSTS, run_dir, ready, "--threads", "1"), log)
        procs.append(coordinator)
        try:
            target = urlsplit(wait_ready(ready, coordinator, log))
        except RuntimeError:
            raise PlacementFailed("the coordinator did not start") from None
        for host in range(HOSTS):
            relays.append(relay := Relay(target.hostname, target.port, up=link, down=link))
            port = await relay.start()
            procs.append(spawn(
                [sys.executable, str(EXCHANGE), "--host", "--model", args.model, "--rounds", str(args.rounds),
                 "--out", str(out)],
                logs / f"host{host}.log",
                env=process_env(NODEOX_HOST_ID=str(host), NODEOX_NUM_HOSTS=str(HOSTS),
                                NODEOX_COORDINATOR_URL=f"http://127.0.0.1:{port}")))
        try:
            await asyncio.wait_for(exited(procs), args.timeout)
        except asyncio.TimeoutError:
            raise PlacementFailed(f"the run did not finish within {args.timeout:.0f} s") from None
        names = ["coordinator", *(f"host{h}" for h in range(HOSTS))]
        failed = [f"{name} (status {p.returncode})" for name, p in zip(names, procs) if p.returncode]
        if failed:
            raise PlacementFailed(f"{', '.join(failed)} failed")
    finally:
        stop(procs, grace=10)
        for relay in relays:
            await relay.close()
    return read_events(run_dir)


def log_tails(run_dir: Path, lines: int = 15) -> str:
    return "\n".join(f"--- {log.name} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
                     for log in sorted(beside(run_dir, "logs").glob("*.log")))


# -- the summary ----------------------------------------------------------------------------------------------------


def summarize(records: list[dict]) -> dict:
    """Medians over rounds 1.. (all rounds when there is only one) of the slowest host, and bytes per host."""
    rounds = report_build()(records)["rounds"]
    rounds = [r for r in rounds if r["round"] >= 1] or rounds

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    seconds = {ph: median([r["host_phases"][ph]["max"] for r in rounds if ph in r["host_phases"]])
               for ph in HOST_PHASES}
    seconds |= {ph: median([r["coordinator_phases"][ph] for r in rounds if ph in r["coordinator_phases"]])
                for ph in COORDINATOR_PHASES}
    to_sync = [r for r in rounds if "max" in r["aggregation_to_sync"]]
    seconds["aggregation_to_sync"] = median([r["aggregation_to_sync"]["max"] for r in to_sync])
    # sync_prepare starts where aggregate ends: the rest is the sync's way to the host, until its body starts
    seconds["sync_ready_to_download"] = median([
        r["aggregation_to_sync"]["max"] - r["coordinator_phases"]["sync_prepare"]
        for r in to_sync if "sync_prepare" in r["coordinator_phases"]])
    per_host = [b for r in rounds for b in r["bytes"].values()]
    return {"median_s": seconds, "delta_bytes": max(b["up"] for b in per_host),
            "sync_bytes": max(b["down"] for b in per_host)}


def compare(placements: dict[str, dict], links: dict[str, Link]) -> dict:
    """The near / far / far-near table and which phases moved with distance."""
    near, far = placements.get("near"), placements.get("far")
    table = {}
    for ph in ROWS:
        a = near["median_s"][ph] if near else None
        b = far["median_s"][ph] if far else None
        table[ph] = {"near": a, "far": b, "difference": None if a is None or b is None else b - a}
    result = {"median_s": table}
    if near and far:
        floor = (links["far"].delay - links["near"].delay) / 2
        result["moved_threshold"] = f"far >= {MOVED_FACTOR:g} x near and far-near > {floor * 1e3:.1f} ms"
        moved = [ph for ph, v in table.items() if v["difference"] is not None
                 and v["far"] >= MOVED_FACTOR * v["near"] and v["difference"] > floor]
        result["moved"] = moved
        result["did_not_move"] = [ph for ph in ROWS if ph not in moved]
    return result


def render(result: dict) -> str:
    links, size = result["links"], result.get("sizes", {})
    lines = [(f"{result['model']}: {HOSTS} hosts, {result['rounds']} rounds; median over rounds 1.. of the slowest "
              "host (timings on a small shared machine are noisy)")]
    lines += [f"  {name:5} link per host, each direction: {v['delay_ms']:g} ms one-way, {v['mbit']:g} Mbit/s"
              for name, v in links.items()]
    if size:
        lines.append(f"  per host and round: delta {size['delta_bytes'] / 1e6:.1f} MB up, "
                     f"sync {size['sync_bytes'] / 1e6:.1f} MB down")
    lines.append("")
    lines.append(f"  {'phase':26} {'near s':>8} {'far s':>8} {'far-near s':>11}")

    def cell(v: float | None, width: int, sign: str = "") -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{sign}{width}.3f}"

    for ph, v in result["median_s"].items():
        who = "host" if ph in HOST_PHASES else "coordinator" if ph in COORDINATOR_PHASES else ""
        lines.append(f"  {(who + ' ' + ph).strip():26} {cell(v['near'], 8)} {cell(v['far'], 8)} "
                     f"{cell(v['difference'], 11, '+')}")
    lines.append("")
    if "moved" in result:
        lines.append(f"moved with distance ({result['moved_threshold']}): {', '.join(result['moved']) or 'none'}")
        lines.append(f"did not move: {', '.join(result['did_not_move']) or 'none'}")
    for name, reason in result["skipped"].items():
        lines.append(f"placement {name} skipped: {reason}")
    if size:
        lines.append("at the links' rates one delta takes " + ", ".join(
            f"{size['delta_bytes'] * 8 / (v['mbit'] * 1e6):.3f} s {name}" for name, v in links.items())
            + "; one round trip is " + ", ".join(f"{2 * v['delay_ms']:g} ms {name}" for name, v in links.items()))
        for phase, key in (("upload", "delta_bytes"), ("download", "sync_bytes")):
            rates = [f"{size[key] * 8 / s / 1e6:.0f} Mbit/s {name}" for name, s in result["median_s"][phase].items()
                     if name in links and s]
            lines.append(f"{phase} achieved (bytes / phase time): {', '.join(rates)}")
    return "\n".join(lines)


async def run_all(args: argparse.Namespace, links: dict[str, Link], workdir: Path) -> dict:
    placements, skipped = {}, {}
    for name, link in links.items():
        run_dir = workdir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        try:
            placements[name] = summarize(await run_placement(link, args, run_dir))
        except (PlacementFailed, OSError) as e:
            skipped[name] = str(e)
            print(f"placement {name}: {e}; skipping it\n{log_tails(run_dir)}", file=sys.stderr)
    result = {"model": args.model, "rounds": args.rounds,
              "links": {name: {"delay_ms": v.delay * 1e3, "mbit": v.rate / 1e6} for name, v in links.items()},
              **compare(placements, links), "skipped": skipped}
    if placements:
        any_run = next(iter(placements.values()))
        result["sizes"] = {"delta_bytes": any_run["delta_bytes"], "sync_bytes": any_run["sync_bytes"]}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="vit_base_patch16_224")
    add_link_options(p)
    p.add_argument("--run-dir", type=Path, help="keep the two runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds each placement may take")
    args = p.parse_args()
    links = links_of(args)
    result = run_async(lambda workdir: run_all(args, links, workdir), args.run_dir, "placement")
    print(json.dumps(result, indent=2) if args.json else render(result))
    if result["skipped"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
