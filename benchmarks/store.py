"""The run's store (``--store``, issue 28) against none: 8 synthetic hosts at ViT-B size, the coordinator behind
one 200 Mbit/s link, an S3 store beside it.

Topology (benchmarks/netns.py, needs root): a hub namespace with a bridge; the coordinator in a namespace of its
own whose veth to the hub is shaped with ``tc tbf`` (``--mbit``, default 200); a moto S3 server (``moto_server``,
its own process: it does not share this benchmark's GIL) and each host in namespaces of their own, unshaped. The
coordinator writes to the store through its shaped link; hosts read the store over their unshaped ones. Hosts are
synthetic: the model's real tensor shapes (timm, on the meta device), a real exchange each round, no training.

Each run starts a fresh coordinator from ``--initial-model`` (a model every host lacks), once without a store
(``direct``: it sends every host the model and the syncs itself) and once with ``--store s3://...`` (``store``:
it writes each once, hosts read them there); arms interleaved, ``--repeats`` times. Measured per run:

- join storm: every host ready (imports, tensors allocated), then all joining at once; the time from the go to
  the last host holding the model (its fetch done). The coordinator's link shaped both ways.
- round: then only the coordinator's egress shaped (its inbound unlimited: metered egress, asymmetric links);
  ``--rounds`` exchanges; per round the first encode start to the last verify end, and its critical path
  (delta in: last upload end; sync made: the coordinator's last sync piece; sync out: the last host's download
  end; verified: the last verify end), medians over rounds with round 0 left out; each phase's slowest host.
  Also the time the coordinator took to write the model to the store (its ``store`` record): hosts read it
  only once it is whole.
- bytes per round (all rounds, round 0 too: total over the rounds / rounds): the coordinator's link counters
  (out and in, HTTP framing and heartbeats included), its status ``sent_bytes`` (sync and model bytes it sent
  itself) and ``store.bytes`` (what it wrote to the store), and the store link's counters (out: what hosts read).

Hosts retry the coordinator for ``--retry-for`` seconds (default 600, nodeox's own default): without a store the
coordinator serves 2 model downloads at once and answers the rest BUSY, and at the former default of 60 s the
storm's later hosts gave up (at ViT-B, 8 hosts, 200 Mbit/s: 4 of 8 failed) before a download slot freed.

Goals (issue 28): join storm at least 4x shorter with the store, round at least 3x shorter. Printed: the median
over repeats of each figure [min-max], and each ratio as the ratio of medians [min-max of the per-repeat
ratios]. Each run is appended to a JSON-lines file as it ends (``--results``).

    python benchmarks/store.py [--repeats 2] [--rounds 3] [--mbit 200] [--hosts 8]
        [--model vit_base_patch16_224] [--results FILE] [--run-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
from common import (
    REPO,
    SampleLog,
    add_results_option,
    beside,
    coordinator_command,
    failure_lines,
    interleaved,
    model_shapes,
    read_events,
    run_async,
    spawn,
    stop,
    tail,
    wait_ready,
)
from netns import SAMPLE_S, Counters, Namespaces, netns_missing, sh
from peers_figures import critical_path, host_payload, slowest_phases
from site_figures import PlacementFailed, sent_between, spread

PREFIX, SUBNET = "nxst", "10.81.0"  # not another benchmark's: they can run side by side
COORDINATOR, STORE = 0, 1  # sites; host h is site 2 + h
ARMS = ("direct", "store")
BUCKET, MOTO_PORT = "nodeox-bench", 5000
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
GOAL_STORM, GOAL_ROUND = 4.0, 3.0  # x shorter with the store
STAGES = ("ready", "fetched", "rounds")  # where hosts wait for the benchmark's go
POLL_S = 0.02


def process_env(**extra: str) -> dict[str, str]:
    """`common.process_env` with this checkout first on the path: an editable install elsewhere (another
    worktree's) must not stand in for the code measured here."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return common.process_env(PYTHONPATH=path, **extra)


# -- the synthetic host (its own process) ----------------------------------------------------------------------


def synthetic_model(shapes: list, seed: int) -> list[tuple[str, object]]:
    """Tensors of ``shapes`` (``[(name, shape)]``), uniform in +-0.05 from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.empty(s).uniform_(-0.05, 0.05, generator=gen)) for n, s in shapes]


def arrive(sync: Path, stage: str, host: str) -> None:
    """Say this host reached ``stage`` (the file holds the time)."""
    (sync / f"{stage}-{host}").write_text(repr(time.time()))


def wait_go(sync: Path, stage: str) -> float:
    """Wait for the benchmark's go at ``stage``; the time it was seen."""
    while not (sync / f"go-{stage}").exists():
        time.sleep(POLL_S)
    return time.time()


def host_main(args: argparse.Namespace) -> None:
    """Ready, join at the go (fetching the coordinator's model: this host's differs), wait, run the rounds, wait,
    leave; its times to ``--out``."""
    import torch

    from lightning_nodeox.core.phases import PhaseLog
    from lightning_nodeox.host.client import HttpClient
    from lightning_nodeox.host.clock import ClockOffset
    from lightning_nodeox.host.heartbeat import Heartbeat
    from lightning_nodeox.host.round import HostRound
    from lightning_nodeox.host.telemetry import TelemetryShipper
    from lightning_nodeox.host.tensors import HostTensors

    torch.set_num_threads(1)
    host, sync = os.environ["NODEOX_HOST_ID"], Path(args.sync)
    named = synthetic_model(json.loads(Path(args.shapes).read_text()), seed=0)  # no timm import: starts sooner
    clock = ClockOffset()
    # retry_for: without a store, the coordinator serves 2 model downloads at once and answers the others BUSY
    # (503); at the default 60 s the storm's later hosts give up long before a slot frees
    client = HttpClient(os.environ["NODEOX_COORDINATOR_URL"], host=host, clock=clock, read_timeout=600,
                        retry_for=args.retry_for)
    beat = Heartbeat(client)
    phases = PhaseLog(host)
    shipper = TelemetryShipper(client, clock)
    phases.listeners.append(shipper)
    exchange = HostRound(HostTensors(named), client, phases, codec_threads=1)
    times = {}
    arrive(sync, "ready", host)
    times["go"] = wait_go(sync, "ready")
    exchange.join()
    times["fetched"] = time.time()
    arrive(sync, "fetched", host)
    wait_go(sync, "fetched")
    for r in range(args.rounds):
        with torch.no_grad():
            for i, (_, t) in enumerate(named):
                t.mul_(1.0 + 1e-3 * (int(host) + 1)).add_(1e-4 * (i % 7))  # this round's "training"
        exchange.run_round(samples=32, final=r == args.rounds - 1)
    arrive(sync, "rounds", host)
    wait_go(sync, "rounds")
    beat.stop()
    shipper.close()
    client.leave()
    Path(args.out).write_text(json.dumps(times))


# -- links and the store -----------------------------------------------------------------------------------------


def shape(net: Namespaces, site: int, mbit: float, *, inbound: bool) -> None:
    """Shape ``site``'s egress to ``mbit`` (its own end of the veth), and its ingress too (the hub's end) when
    ``inbound``; otherwise its ingress is left unshaped."""
    sh("tc", "-n", net.names[site], "qdisc", "replace", "dev", net.dev(site), "root", "tbf", "rate", f"{mbit:g}mbit",
       "burst", "128kb", "latency", "100ms")
    if inbound:
        sh("tc", "-n", net.hub, "qdisc", "replace", "dev", net.hub_end(site), "root", "tbf", "rate",
           f"{mbit:g}mbit", "burst", "128kb", "latency", "100ms")
    else:
        subprocess.run(["tc", "-n", net.hub, "qdisc", "del", "dev", net.hub_end(site), "root"], check=False,
                       capture_output=True)


def in_hub(net: Namespaces, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """``cmd`` run in the hub namespace (this process is not in any of the run's namespaces)."""
    return subprocess.run([*net.exec(None), *cmd], check=False, capture_output=True, text=True, timeout=timeout)


def start_store(net: Namespaces, logs: Path) -> tuple[subprocess.Popen, str]:
    """``moto_server`` in the store's namespace, its bucket made; the process and its endpoint URL."""
    moto = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if moto is None:
        raise RuntimeError("moto_server not found: pip install 'moto[server]'")
    endpoint = f"http://{net.ip(STORE)}:{MOTO_PORT}"
    proc = spawn([*net.exec(STORE), moto, "-H", net.ip(STORE), "-p", str(MOTO_PORT)], logs / "moto.log")
    deadline = time.monotonic() + 60
    while in_hub(net, "curl", "-s", "-o", "/dev/null", "--max-time", "2", endpoint).returncode:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop([proc])
            raise RuntimeError(f"moto_server did not start:\n{tail(logs / 'moto.log')}")
        time.sleep(0.2)
    made = subprocess.run([*net.exec(None), sys.executable, "-c",
                           f"import boto3; boto3.client('s3').create_bucket(Bucket={BUCKET!r})"],
                          env=process_env(AWS_ENDPOINT_URL=endpoint, **AWS), capture_output=True, text=True)
    if made.returncode:
        stop([proc])
        raise RuntimeError(f"the bucket could not be made: {made.stderr.strip()[-500:]}")
    return proc, endpoint


def coordinator_status(net: Namespaces, url: str) -> dict:
    """The coordinator's GET /v1/status, asked from the hub."""
    done = in_hub(net, "curl", "-sf", "--max-time", "20", f"{url}/v1/status")
    if done.returncode:
        raise PlacementFailed(f"GET {url}/v1/status failed: curl status {done.returncode} {done.stderr.strip()}")
    return json.loads(done.stdout)


def write_model_files(model: str, shapes: Path, initial: Path) -> None:
    """Timm model ``model``'s shapes (for the hosts) and the run's starting model as a safetensors file: a seed no
    host starts from, so every host fetches it."""
    from safetensors.torch import save_file

    named = model_shapes(model)
    shapes.write_text(json.dumps(named))
    save_file(dict(synthetic_model(named, seed=1)), str(initial))


# -- one run -----------------------------------------------------------------------------------------------------


class Stages:
    """The hosts' waiting points (files in ``folder``): when all arrived, and the go."""

    def __init__(self, folder: Path, hosts: int) -> None:
        self.folder, self.hosts = folder, hosts
        folder.mkdir(parents=True, exist_ok=True)

    async def all_at(self, stage: str, procs: dict[str, subprocess.Popen], timeout: float, logs: Path) -> float:
        """Wait for every host at ``stage`` (a process that ended is a failure); the last one's time."""
        deadline = time.monotonic() + timeout
        files = [self.folder / f"{stage}-{h}" for h in range(self.hosts)]
        while not all(f.exists() for f in files):
            ended = [f"{n} (status {p.returncode})" for n, p in procs.items() if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                why = f"{', '.join(ended)} ended" if ended else f"not all hosts at {stage} within {timeout:.0f} s"
                raise PlacementFailed(f"{why}:\n" + "\n".join(
                    f"--- {f.name} ---\n{tail(f)}" for f in sorted(logs.glob("*.log"))))
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(0.05)  # the file's text is written just after it appears
        return max(float(f.read_text() or 0) for f in files)

    def go(self, stage: str) -> float:
        (self.folder / f"go-{stage}").touch()
        return time.time()


async def sampling(counters: Counters) -> None:
    """Sample the links' counters until cancelled."""
    while True:
        counters.sample()
        await asyncio.sleep(SAMPLE_S)


def coordinator_env(endpoint: str | None) -> dict[str, str]:
    return process_env(**AWS, **({"AWS_ENDPOINT_URL": endpoint} if endpoint else {}))


async def run_arm(arm: str, rep: int, net: Namespaces, args: argparse.Namespace, workdir: Path,
                  endpoint: str, initial: Path) -> dict:
    """One run of ``arm`` (direct or store): the join storm, then the rounds; its figures."""
    run_dir = workdir / f"{arm}-{rep}"
    logs, out, stages = beside(run_dir, "logs"), beside(run_dir, "out"), Stages(beside(run_dir, "sync"), args.hosts)
    for d in (run_dir, logs, out):
        d.mkdir(parents=True, exist_ok=True)
    shape(net, COORDINATOR, args.mbit, inbound=True)
    store = ["--store", f"s3://{BUCKET}/{arm}-{rep}"] if arm == "store" else []
    ready, log = run_dir / "ready", logs / "coordinator.log"
    procs: dict[str, subprocess.Popen] = {}
    counters = Counters(net)
    sampler = asyncio.ensure_future(sampling(counters))
    try:
        procs["coordinator"] = spawn([*net.exec(COORDINATOR), *coordinator_command(
            args.hosts, run_dir, ready, "--insecure", "--initial-model", str(initial), "--rss-interval", "1", *store,
            bind=f"{net.ip(COORDINATOR)}:0")], log, env=coordinator_env(endpoint))
        url = await asyncio.to_thread(wait_ready, ready, procs["coordinator"], log)
        for h in range(args.hosts):
            procs[f"host{h}"] = spawn(
                [*net.exec(2 + h), sys.executable, __file__, "--host", "--shapes", str(workdir / "shapes.json"),
                 "--rounds", str(args.rounds), "--retry-for", str(args.retry_for), "--sync", str(stages.folder),
                 "--out", str(out / f"host{h}.json")],
                logs / f"host{h}.log", env=process_env(NODEOX_HOST_ID=str(h), NODEOX_COORDINATOR_URL=url, **AWS))
        await stages.all_at("ready", procs, args.timeout, logs)
        t_go = stages.go("ready")
        t_fetched = await stages.all_at("fetched", procs, args.timeout, logs)
        at_fetched = time.time()
        shape(net, COORDINATOR, args.mbit, inbound=False)  # the rounds: egress-bound
        before = coordinator_status(net, url)
        t_rounds = stages.go("fetched")
        await stages.all_at("rounds", procs, args.timeout, logs)
        t_done = time.time()
        after = coordinator_status(net, url)
        stages.go("rounds")
        await asyncio.to_thread(lambda: [p.wait(60) for n, p in procs.items() if n != "coordinator"])
    finally:
        sampler.cancel()
        stop(list(procs.values()), grace=10)
    counters.sample()
    records = read_events(run_dir)
    stored = store_records(records)
    return {"arm": arm, "repeat": rep, "storm_s": t_fetched - t_go,
            "storm_model_to_store_s": next((r["s"] for r in stored if r["what"] == "model"), None),
            **storm_bytes(counters, t_go, at_fetched, args.hosts),
            **round_figures(records, args.rounds),
            **round_bytes(counters, before, after, t_rounds, t_done, args.rounds, args.hosts),
            "store_records": stored}


def storm_bytes(counters: Counters, start: float, end: float, hosts: int) -> dict:
    """What the coordinator sent and the store served during the storm, and what the hosts got on average."""
    return {"storm_coordinator_out_bytes": sent_between(counters.up[COORDINATOR], start, end),
            "storm_store_out_bytes": sent_between(counters.up[STORE], start, end),
            "storm_host_in_bytes": sum(sent_between(counters.down[2 + h], start, end) for h in range(hosts)) / hosts}


def round_bytes(counters: Counters, before: dict, after: dict, start: float, end: float, rounds: int,
                hosts: int) -> dict:
    """Per round over all rounds: the coordinator's link both ways, its own count of what it sent and wrote to
    the store, the store link's bytes out, a host's bytes in."""
    stored = after.get("store", {}).get("bytes", 0) - before.get("store", {}).get("bytes", 0)
    return {"coordinator_out_bytes": sent_between(counters.up[COORDINATOR], start, end) / rounds,
            "coordinator_in_bytes": sent_between(counters.down[COORDINATOR], start, end) / rounds,
            "status_sent_bytes": (sum(after["sent_bytes"].values()) - sum(before["sent_bytes"].values())) / rounds,
            "status_store_bytes": stored / rounds,
            "store_out_bytes": sent_between(counters.up[STORE], start, end) / rounds,
            "host_in_bytes": sum(sent_between(counters.down[2 + h], start, end) for h in range(hosts)) / hosts / rounds}


def store_records(records: list[dict]) -> list[dict]:
    """The coordinator's ``store`` records: per upload its round, what, bytes, requests and seconds."""
    return [{"round": r["round"], "what": r.get("what"), "bytes": r.get("bytes"), "requests": r.get("requests"),
             "s": r["end"] - r["start"]} for r in records if r["phase"] == "store"]


# -- figures -----------------------------------------------------------------------------------------------------


def round_figures(records: list[dict], rounds: int) -> dict:
    """Medians over rounds (round 0 left out when there are more) of the round and its critical path; the
    slowest host's phases; the sync's size."""
    counted = range(1, rounds) if rounds > 1 else range(rounds)
    paths = [{f"{part}_s": s for part, s in critical_path(records, r).items()} for r in counted]
    payload = host_payload(records)
    return {**{k: statistics.median(p[k] for p in paths) for k in paths[0]},
            "rounds": paths, "phases": slowest_phases(records),
            "payload_bytes": statistics.median(payload.get(r, 0) for r in counted)}


FIGURES = (("storm_s", "join storm, s", 1), ("storm_model_to_store_s", "  the model written to the store, s", 1),
           ("round_s", "round, s", 1), ("delta_in_s", "  delta in, s", 1),
           ("sync_made_s", "  sync made, s", 1), ("sync_out_s", "  sync out, s", 1),
           ("verified_s", "  verified, s", 1), ("storm_coordinator_out_bytes", "storm: coordinator out, MB", 1e6),
           ("storm_store_out_bytes", "storm: store out, MB", 1e6),
           ("coordinator_out_bytes", "round: coordinator out, MB (link)", 1e6),
           ("coordinator_in_bytes", "round: coordinator in, MB (link)", 1e6),
           ("status_sent_bytes", "round: status sent_bytes, MB", 1e6),
           ("status_store_bytes", "round: status store.bytes, MB", 1e6),
           ("store_out_bytes", "round: store out, MB (link)", 1e6),
           ("host_in_bytes", "round: a host's in, MB (link)", 1e6),
           ("payload_bytes", "sync (a host's largest body), MB", 1e6))
GOALS = (("storm_s", "join storm at least {:g}x shorter with the store", GOAL_STORM),
         ("round_s", "round at least {:g}x shorter with the store", GOAL_ROUND))


def goals(runs: dict[str, list[dict]]) -> list[dict]:
    """Each goal: the ratio of medians (direct / store) and the range of the per-repeat ratios."""
    out = []
    pairs = [(d, s) for d in runs["direct"] for s in runs["store"] if d["repeat"] == s["repeat"]]
    for metric, text, at_least in GOALS:
        if not pairs:
            continue
        ratio = statistics.median(d[metric] for d, _ in pairs) / statistics.median(s[metric] for _, s in pairs)
        each = [d[metric] / s[metric] for d, s in pairs]
        out.append({"goal": text.format(at_least), "metric": metric, "measured": ratio, "range": [min(each), max(each)],
                    "met": ratio >= at_least})
    return out


def render(result: dict) -> str:
    runs = result["runs"]
    lines = [f"{result['model']}: {result['hosts']} hosts, coordinator link {result['mbit']:g} Mbit/s (tc tbf; both "
             f"ways for the storm, its egress only for the rounds), store and hosts unshaped; {result['rounds']} "
             f"rounds (round 0 left out of times); {result['repeats']} repeat(s), arms interleaved",
             "  figures: median over repeats [min-max]", "",
             f"  {'':36} {'direct':>22} {'store':>22} {'direct/store':>14}"]

    def cell(arm: str, key: str, scale: float) -> str:
        values = [r[key] / scale for r in runs.get(arm, []) if r.get(key) is not None]
        if not values:
            return "-"
        s = spread(values)
        return f"{s['median']:.1f} [{s['min']:.1f}-{s['max']:.1f}]"

    for key, label, scale in FIGURES:
        d = [r[key] for r in runs.get("direct", []) if r.get(key) is not None]
        s = [r[key] for r in runs.get("store", []) if r.get(key) is not None]
        md, ms = (statistics.median(d), statistics.median(s)) if d and s else (0, 0)
        ratio = f"{md / ms:.2f}x" if min(md, ms) > 0.01 * max(md, ms) else "-"  # not of a side that is ~0
        lines.append(f"  {label:36} {cell('direct', key, scale):>22} {cell('store', key, scale):>22} {ratio:>14}")
    lines += failure_lines(result["failed"], result["results"])
    lines += ["", "goals (ratio of medians [range of per-repeat ratios]):"]
    for g in result["goals"]:
        lines.append(f"  {'MET   ' if g['met'] else 'MISSED'} {g['goal']}: {g['measured']:.2f}x "
                     f"[{g['range'][0]:.2f}-{g['range'][1]:.2f}]")
    if not result["goals"]:
        lines.append("  none measured (an arm did not run)")
    return "\n".join(lines)


# -- the benchmark -----------------------------------------------------------------------------------------------


async def run_all(args: argparse.Namespace, workdir: Path) -> dict:
    log = SampleLog("store", args.results)
    workdir.mkdir(parents=True, exist_ok=True)
    initial, shapes = workdir / "initial.safetensors", workdir / "shapes.json"
    await asyncio.to_thread(write_model_files, args.model, shapes, initial)
    net = Namespaces(2 + args.hosts, None, PREFIX, SUBNET)
    with net:
        logs = workdir / "store-logs"
        logs.mkdir(parents=True, exist_ok=True)
        moto, endpoint = start_store(net, logs)
        try:
            runs = await interleaved(list(ARMS), args.repeats,
                                     lambda arm, rep: run_arm(arm, rep, net, args, workdir, endpoint, initial),
                                     {}, f"{args.mbit:g} Mbit/s", ("storm_s", "round_s"), log)
        finally:
            stop([moto], grace=5)
    return {"model": args.model, "hosts": args.hosts, "mbit": args.mbit, "rounds": args.rounds,
            "repeats": args.repeats, "runs": runs, "goals": goals(runs), "failed": log.failures,
            "results": str(log.path)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hosts", type=int, default=8)
    p.add_argument("--mbit", type=float, default=200.0, help="the coordinator's link, Mbit/s (default 200)")
    p.add_argument("--model", default="vit_base_patch16_224")
    p.add_argument("--run-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each stage of a run may take")
    add_results_option(p)
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--retry-for", type=float, default=600.0,
                   help="the hosts' retry_for, seconds (default 600; nodeox's own default, 60, fails the storm "
                        "without a store: see the module's docstring)")
    p.add_argument("--sync", help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.host:
        host_main(args)
        return
    if why := netns_missing():
        p.error(f"needs network namespaces: {why}")
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 0 is left out of times)")
    result = run_async(lambda workdir: run_all(args, workdir), args.run_dir, "store")
    print(json.dumps(result, indent=2, default=str) if args.json else render(result))


if __name__ == "__main__":
    main()
