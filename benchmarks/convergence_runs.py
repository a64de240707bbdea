"""Running one mode of benchmarks/convergence.py once, for one seed: DDP's ranks, `nodeox launch` for a Nodeox mode,
or a coordinator and hosts started one by one for an epoch mode (and its faults). Every host is convergence.py itself
(``--host``, benchmarks/convergence_host.py); a run's figures are read from the hosts' results and the run's events.
Before the runs, what this lightning_nodeox lacks for a mode (`preflight`, `missing_option`)."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, coordinator_command, process_env, read_events, spawn, stop, tail, wait_all, wait_ready
from convergence_host import split_size
from convergence_metrics import ddp_bytes_per_host, host_records, nodeox_bytes_sent, peak_exchange_bytes, wait_share
from convergence_modes import (DATA_UNIT, EPOCH_HOSTS, EPOCH_LOCAL_STEPS, HOSTS, KILL_AFTER, MODES, RESTART_EPOCH,
                               SLOWDOWN, WORKLOADS)

from lightning_nodeox.tools.environments import cpu_shares

CONVERGENCE = Path(__file__).resolve().with_name("convergence.py")  # a host is this benchmark's script, with --host


def run_timeout(args: argparse.Namespace) -> float:
    """Seconds one run may take: the workload's, longer in proportion for more steps than its default."""
    workload = WORKLOADS[args.workload]
    return workload.timeout * max(1.0, args.steps / workload.steps)


class Unavailable(Exception):
    """This mode's options are not in this version of lightning_nodeox."""


def _host_args(args: argparse.Namespace, kind: str, seed: int, out: Path, steps: list[int], strategy: dict,
               slow: bool, local_steps: int | None = None, slowdown: float = SLOWDOWN, stalls: int = 0,
               pace: float = 0.0) -> list[str]:
    """A host's command line; ``steps``: each host's optimizer steps, one per host (launch runs one command for all
    hosts); ``local_steps``: the mode's own (default ``--local-steps``); host 1, when ``slow``, runs ``slowdown``
    times slower and stalls ``stalls`` times."""
    return [sys.executable, str(CONVERGENCE), "--host", "--kind", kind, "--workload", args.workload,
            "--seed", str(seed), "--out", str(out), "--host-steps", ",".join(map(str, steps)),
            "--local-steps", str(local_steps or args.local_steps), "--batch-size",
            str(args.batch_size), "--lr", str(args.lr), "--strategy-kwargs", json.dumps(strategy),
            "--slow-host", "1" if slow else "-1", "--slowdown", str(slowdown), "--stalls", str(stalls),
            "--pace", str(pace), "--num-hosts", str(len(steps)), "--eval-every", str(args.eval_every)]


def _read_hosts(out: Path, n: int) -> dict[str, dict]:
    hosts = {}
    for i in range(n):
        f = out / f"host{i}.json"
        if f.exists():
            hosts[str(i)] = json.loads(f.read_text())
    for h in hosts.values():
        if "unavailable" in h:
            raise Unavailable(h["unavailable"])
    return hosts


def run_ddp(args: argparse.Namespace, seed: int, workdir: Path) -> dict:
    out = workdir / "out"
    out.mkdir(parents=True)
    env = process_env(WORLD_SIZE=str(HOSTS), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
                      GLOO_SOCKET_IFNAME="lo")
    cmd = _host_args(args, "ddp", seed, out, [args.steps] * HOSTS, {}, False) + ["--store", str(workdir / "store")]
    shares = cpu_shares(HOSTS)
    procs = []
    started = time.time()
    try:
        for i in range(HOSTS):
            procs.append(spawn(cmd, workdir / f"rank{i}.log", env=dict(env, NODE_RANK=str(i)), cpus=shares[i],
                               cwd=REPO))
        codes = wait_all(procs, run_timeout(args))
    finally:
        stop(procs)
    if any(codes):
        raise RuntimeError(f"DDP exited with {codes}:\n{tail(workdir / 'rank0.log')}\n{tail(workdir / 'rank1.log')}")
    hosts = _read_hosts(out, HOSTS)
    param_bytes = hosts["0"]["param_bytes"]
    sent = {h: ddp_bytes_per_host(param_bytes, v["steps"]) for h, v in hosts.items()}
    step = ddp_bytes_per_host(param_bytes, 1)  # an exchange: one step's all-reduce
    return _result(hosts, sent, {h: None for h in hosts}, time.time() - started, {},
                   {"peak_bytes": step, "final_bytes": step})


def run_nodeox(args: argparse.Namespace, mode: str, seed: int, workdir: Path, round_seconds: float | None) -> dict:
    spec = MODES[mode]
    out, run_dir = workdir / "out", workdir / "run"
    out.mkdir(parents=True)
    strategy = dict(spec.get("strategy", {}))
    n, sites = spec.get("hosts", HOSTS), spec.get("sites", 1)
    steps = [args.steps] * n
    if strategy.get("round_seconds") == "auto":
        if round_seconds is None:
            raise RuntimeError("no round_seconds: no earlier Nodeox run measured host 0's step time")
        strategy["round_seconds"] = round_seconds
        # a time budget: the same samples in all, each host's share in proportion to its speed, so both end together
        total = args.steps * n
        slowdown = spec.get("slowdown", SLOWDOWN)
        speeds = [1.0 / slowdown if spec.get("slow") and i == 1 else 1.0 for i in range(n)]
        steps = [round(total * s / sum(speeds)) for s in speeds]
    shape = ["--hosts", str(n), *(["--sites", str(sites)] if sites > 1 else [])]  # --sites: a relay per site
    cmd = [sys.executable, "-m", "lightning_nodeox", "launch", *shape, "--run-dir", str(run_dir), "--threads", "1",
           *spec.get("coordinator", []), "--", *_host_args(args, "nodeox", seed, out, steps, strategy,
                                                           spec.get("slow", False), spec.get("local_steps"),
                                                           spec.get("slowdown", SLOWDOWN), spec.get("stalls", 0),
                                                           spec.get("pace", 0.0))]
    env = process_env()
    log = workdir / "launch.log"
    started = time.time()
    proc = spawn(cmd, log, env=env, cwd=REPO)
    try:
        refused = [out / f"host{i}.json" for i in range(n)]  # a host refused this mode's options: stop early
        codes = wait_all([proc], run_timeout(args),
                          lambda: any(f.exists() and "unavailable" in f.read_text() for f in refused))
    finally:
        stop([proc])
    text = log.read_text(errors="replace")
    for needle in ("unrecognized arguments", "invalid choice"):
        if needle in text:
            line = next((ln for ln in text.splitlines() if needle in ln and "error:" in ln), None)
            if line:  # nodeox's argument parser refused a coordinator option of this mode
                raise Unavailable(f"nodeox: {line.split('error:')[-1].strip()}")
    hosts = _read_hosts(out, n)
    if codes[0] or len(hosts) < n:
        raise RuntimeError(f"nodeox launch exited with {codes[0]}:\n{tail(log, 25)}")
    events = read_events(run_dir)
    records = {h: host_records(events, h) for h in hosts}
    sent = {h: nodeox_bytes_sent(r) for h, r in records.items()}
    peaks = {h: peak_exchange_bytes(r) for h, r in records.items()}
    waits = {h: wait_share(r) for h, r in records.items()}
    last = max((e["round"] for e in events if "round" in e), default=0)
    final = max((e["round"] for e in events if e["phase"] == "sync_prepare" and e["host"] == "coordinator"), default=0)
    steady = {h: wait_share([x for x in r if x["round"] < final]) for h, r in records.items()}  # the final round apart
    step_s = {}
    for h, rs in records.items():
        per_step = [(r["end"] - r["start"]) / r["steps"] for r in rs if r["phase"] == "train" and r.get("steps")]
        step_s[h] = statistics.median(per_step) if per_step else None
    return _result(hosts, sent, waits, time.time() - started, step_s,
                   {"round_seconds": strategy.get("round_seconds"), "rounds": last, "wait_share_steady": steady,
                    "peak_bytes": statistics.mean(p[0] for p in peaks.values()),
                    "final_bytes": statistics.mean(p[1] for p in peaks.values())})


def run_epochs(args: argparse.Namespace, mode: str, seed: int, workdir: Path) -> dict:
    """An epoch mode: a coordinator and 3 hosts of --epochs passes each (with faults: host 1 killed with -9 once it
    trained KILL_AFTER steps of epoch 1, and host 3 joining then; the coordinator killed with -9 once host 0 trained
    KILL_AFTER steps of RESTART_EPOCH, and started again); the samples the published model trained, lost or
    repeated per epoch (benchmarks/epoch_samples.py)."""
    import signal

    import epoch_samples

    spec = MODES[mode]
    out, run_dir, ready, log = workdir / "out", workdir / "run", workdir / "ready", workdir / "coordinator.log"
    out.mkdir(parents=True)
    faults, ledger = spec.get("faults", False), spec.get("ledger", False)
    bind = f"127.0.0.1:{_free_port()}"  # the same after a restart: the hosts know its URL
    options = ["--threads", "1", "--data-unit", str(DATA_UNIT), "--lease", "3", *(["--elastic"] if faults else [])]
    coordinator = spawn(coordinator_command(EPOCH_HOSTS, run_dir, ready, *options, bind=bind), log, cwd=REPO)
    cmd = _host_args(args, "nodeox", seed, out, [args.steps] * EPOCH_HOSTS, {}, False, EPOCH_LOCAL_STEPS)
    cmd += ["--host-steps", ",".join([str(args.steps)] * (EPOCH_HOSTS + 1)), "--host-epochs", str(args.epochs),
            *(["--ledger"] if ledger else [])]
    hosts: dict[int, subprocess.Popen] = {}
    started = time.time()
    try:
        url = wait_ready(ready, coordinator, log)

        def start(h: int, *extra: str) -> None:
            env = process_env(NODEOX_HOST_ID=str(h), NODEOX_COORDINATOR_URL=url)
            hosts[h] = spawn([*cmd, *extra], workdir / f"host{h}.log", env=env, cwd=REPO)

        for h in range(EPOCH_HOSTS):
            start(h)
        join = workdir / "join"
        if faults:  # the joining host, started now (its imports take seconds), joins once told
            start(EPOCH_HOSTS, "--join-when", str(join))
        if faults:
            deadline = time.monotonic() + run_timeout(args)
            _steps_into(out, 1, 1, hosts[1], deadline)
            hosts[1].send_signal(signal.SIGKILL)
            hosts[1].wait(30)
            join.touch()
            _steps_into(out, 0, RESTART_EPOCH, hosts[0], deadline)
            coordinator.send_signal(signal.SIGKILL)  # and started again on its run directory: it resumes
            coordinator.wait(30)
            ready, log = workdir / "ready-restarted", workdir / "coordinator-restarted.log"
            coordinator = spawn(coordinator_command(EPOCH_HOSTS, run_dir, ready, *options, bind=bind), log, cwd=REPO)
            wait_ready(ready, coordinator, log)
        # the run ends with its first host's last epoch; a host that joined late may still be joining: not waited for
        codes = wait_all([hosts[0], hosts[2], coordinator], run_timeout(args))
    finally:
        stop([*hosts.values(), coordinator])
    if any(codes):
        raise RuntimeError(f"an epoch run exited with {codes}:\n{tail(log, 25)}\n{tail(workdir / 'host0.log', 25)}")
    results = _read_hosts(out, EPOCH_HOSTS + 1)
    events = read_events(run_dir)
    records = {h: host_records(events, h) for h in results}
    epochs = epoch_samples.per_epoch(out, events, split_size(), ledger, args.epochs)
    wrong = epoch_samples.ledger_disagreements(out, events) if ledger else {}
    if wrong:  # the hosts' logs joined by time miscount what the ledger says the published rounds took
        raise RuntimeError(f"epoch counts disagree with the ledger's data records, (host, round): (counted, "
                           f"ledger's) {wrong}")
    return _result(results, {h: nodeox_bytes_sent(r) for h, r in records.items()},
                   {h: wait_share(r) for h, r in records.items()}, time.time() - started, {},
                   {"epochs": epochs, "rounds": max((e["round"] for e in events if "round" in e), default=0)})


def _steps_into(out: Path, host: int, epoch: int, proc: subprocess.Popen, deadline: float) -> None:
    """Wait until ``host`` has trained KILL_AFTER steps of its epoch ``epoch``."""
    log = out / f"host{host}_trained.jsonl"
    while sum(1 for line in (log.read_text().splitlines() if log.exists() else [])
              if line.endswith("]") and json.loads(line)[1] >= epoch) < KILL_AFTER:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"host {host} never reached epoch {epoch}:\n{tail(out.parent / f'host{host}.log', 25)}")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(hosts: dict, sent: dict, waits: dict, run_wall: float, step_s: dict, extra: dict | None = None) -> dict:
    """One run's figures; its metrics (accuracy, or val_loss and perplexity) are host 0's, with ``KEY_per_host``."""
    same = len({v["param_digest"] for v in hosts.values()}) == 1
    metrics = {k: v for k, v in hosts["0"].items() if k in ("accuracy", "test_samples", "val_loss", "perplexity",
                                                              "val_tokens")}
    per_host = {f"{k}_per_host": {h: v[k] for h, v in hosts.items()} for k in ("accuracy", "val_loss")
                if k in hosts["0"]}
    if "curve" in hosts["0"]:
        metrics["curve"] = hosts["0"]["curve"]  # host 0's evaluations along the run
    return {
        **metrics, **per_host,
        "hosts_identical": same,
        "model_hash": hosts["0"].get("model_hash"), "bytes_per_host": statistics.mean(sent.values()),
        "bytes_sent": sent, "wall_s": max(v["fit_wall_s"] for v in hosts.values()), "run_wall_s": run_wall,
        "wait_share": waits, "samples": {h: v["samples"] for h, v in hosts.items()},
        "steps": {h: v["steps"] for h, v in hosts.items()}, "step_s": step_s, "param_bytes": hosts["0"]["param_bytes"],
        **(extra or {}),
    }


def preflight() -> tuple[str, set[str] | None]:
    """`nodeox launch --help` and NodeoxStrategy's keyword arguments (None: it takes **kwargs, cannot tell)."""
    launch_help = subprocess.run([sys.executable, "-m", "lightning_nodeox", "launch", "--help"], capture_output=True,
                                 text=True, timeout=120, cwd=REPO, check=False).stdout
    probe = ("import inspect, json; from lightning_nodeox import NodeoxStrategy as S; "
             "ps = inspect.signature(S.__init__).parameters.values(); "
             "print(json.dumps(None if any(p.kind == p.VAR_KEYWORD for p in ps) else [p.name for p in ps]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO,
                          check=False)
    names = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
    return launch_help, None if names is None else set(names)


def missing_option(mode: str, launch_help: str, strategy_params: set[str] | None) -> str | None:
    """What this mode needs that lightning_nodeox does not have yet (None: all there, as far as can be told)."""
    import re

    spec = MODES[mode]
    for opt in spec.get("coordinator", []) + (["--sites"] if spec.get("sites", 1) > 1 else []):
        if opt.startswith("--") and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", launch_help):
            return f"coordinator option {opt}"
    for name in spec.get("strategy", {}):
        if strategy_params is not None and name not in strategy_params:
            return f"NodeoxStrategy({name}=...)"
    return None
