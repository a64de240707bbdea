"""``nodeox launch``: a coordinator and N host processes on this machine, outputs streamed with a prefix.

Host i gets ``NODEOX_HOST_ID=i``, ``NODEOX_LOCAL_HOST_RANK=i`` (its place on this machine), ``NODEOX_NUM_HOSTS``,
``NODEOX_COORDINATOR_URL``, ``NODEOX_TOKEN`` (when set), ``NODEOX_RUN_DIR``, and with ``--tls-cert``
``NODEOX_CA_FILE`` set to that certificate unless the environment sets it (right for a self-signed
certificate); when this machine has at least N x ``gpus_per_host`` GPUs each host sees only its own
(``CUDA_VISIBLE_DEVICES``), and when it has at least N CPUs each host is pinned to its own share of them, so that
the hosts do not oversubscribe the CPU. A host of several GPUs runs ``Trainer(devices=K)``, and Lightning starts
its other ranks (they share the host's output prefix and CPU share).

Outputs are shown line by line with a prefix, as a terminal would have shown them (:mod:`.console`): a progress bar
in its last state, never its refreshes or escape sequences; stdout and stderr read apart, so lines never run
together; Lightning's start-up chatter and Python warnings that every host prints alike shown once per launch. A
host that fails (exits non-zero, e.g. after a SIGTERM) is named at once; the others go on (as on a cluster: it left,
or its lease expires), and launch exits non-zero. If the coordinator fails, the hosts are stopped.

Ctrl-C (SIGINT) or SIGTERM stops the run, resumable: every child runs in a process group of its own, so the
terminal's SIGINT reaches launch alone; launch sends SIGTERM to the hosts (they leave and exit 143, without
tracebacks), then to the coordinator (it saves the run unfinished), and prints one line per process. The same
command started again resumes the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..coordinator.config import CoordinatorConfig
from ..core.cpu import granted_cpus
from ..core.settings import (
    ENV_CA_FILE, ENV_HOST_ID, ENV_LOCAL_RANK, ENV_NUM_HOSTS, ENV_RUN_DIR, ENV_TOKEN, ENV_URL,
)
from .console import Console

STOP_GRACE = 10.0


def _start(cmd: list[str], env: dict, prefix: str, console: Console,
           cpus: list[int] | None = None) -> tuple[subprocess.Popen, list[threading.Thread]]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            process_group=0)  # a Ctrl-C in the terminal reaches launch, which forwards SIGTERM
    if cpus:
        try:
            os.sched_setaffinity(proc.pid, cpus)  # before the interpreter has started any thread of its own
        except OSError:
            pass
    threads = [threading.Thread(target=console.follow, args=(prefix, pipe), daemon=True)
               for pipe in (proc.stdout, proc.stderr)]
    for t in threads:
        t.start()
    return proc, threads


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _gpu_count() -> int:
    """NVIDIA GPUs on this machine, from the driver (importing torch here would cost launch 0.7 GiB)."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def gpu_sets(gpus: int, hosts: int, per_host: int) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each host: its own ``per_host`` GPUs when there are enough, else None (every
    host sees every GPU)."""
    if gpus < hosts * per_host:
        return [None] * hosts
    return [",".join(str(i * per_host + j) for j in range(per_host)) for i in range(hosts)]


def _exit_status(code: int) -> str:
    """How a process ended, from its return code (negative: killed by a signal; 128+N: exited for signal N)."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        name = signal.Signals(number).name if number else ""
    except ValueError:
        name = ""
    return f"exit status {code}" + (f" ({name})" if name else "")


def cpu_shares(hosts: int) -> list[list[int] | None]:
    """Disjoint CPU sets for the hosts when there are enough CPUs; None (no pinning) otherwise."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return [None] * hosts
    per = min(len(cpus), granted_cpus()) // hosts
    if per < 1:
        return [None] * hosts
    return [cpus[i * per : (i + 1) * per] for i in range(hosts)]


def launch(config: CoordinatorConfig, coordinator_args: list[str], command: list[str], gpus_per_host: int = 1) -> int:
    """Run a coordinator (``nodeox coordinator COORDINATOR_ARGS``, the command line ``config`` was read from) and
    ``config.hosts`` copies of ``command``; returns the exit status."""
    hosts, run_dir, token, tls_cert = config.hosts, Path(config.run_dir), config.token, config.tls_cert
    if not command:
        print("nodeox launch: give the host command after --, e.g. "
              "nodeox launch --hosts 2 --run-dir runs/demo -- python examples/finetune_vit.py", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    ready = run_dir / ".coordinator-url"
    ready.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    coord_cmd = [sys.executable, "-m", "lightning_nodeox", "coordinator", *coordinator_args, "--ready-file", str(ready)]
    console = Console()
    coordinator, coord_threads = _start(coord_cmd, env, "[coordinator]", console)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if coordinator.poll() is not None or time.monotonic() > deadline:
            _stop([coordinator])
            for t in coord_threads:
                t.join(5)
            print("nodeox launch: the coordinator did not start (see its output above)", file=sys.stderr)
            return 1
        time.sleep(0.05)
    url = ready.read_text().strip()
    gpus = _gpu_count()
    visible = gpu_sets(gpus, hosts, gpus_per_host)
    if 0 < gpus < hosts * gpus_per_host and "CUDA_VISIBLE_DEVICES" not in os.environ:
        console.say(f"nodeox launch: {gpus} GPUs for {hosts} hosts of {gpus_per_host}: every host sees every GPU")
    shares = cpu_shares(hosts)
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    for i in range(hosts):
        host_env = {**env, ENV_HOST_ID: str(i), ENV_LOCAL_RANK: str(i), ENV_NUM_HOSTS: str(hosts), ENV_URL: url,
                    ENV_RUN_DIR: str(run_dir)}
        if token:
            host_env[ENV_TOKEN] = token
        if tls_cert is not None and ENV_CA_FILE not in os.environ:
            host_env[ENV_CA_FILE] = str(Path(tls_cert).resolve())
        if visible[i] is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
            host_env["CUDA_VISIBLE_DEVICES"] = visible[i]
        if shares[i] is not None and "OMP_NUM_THREADS" not in os.environ:
            host_env["OMP_NUM_THREADS"] = str(len(shares[i]))
        proc, followers = _start(command, host_env, f"[host {i}]", console, shares[i])
        procs.append(proc)
        threads += followers

    def forward(signum, _frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # one stop at a time; it ends within 2 x STOP_GRACE
        console.say(f"nodeox launch: {signal.Signals(signum).name}: stopping the hosts, then the coordinator (the run "
                    "is saved; the same command resumes it)")
        _stop(procs)  # first: they say goodbye while the coordinator listens
        _stop([coordinator])
        for t in threads + coord_threads:
            t.join(5)
        for name, p in [*((f"host {i}", p) for i, p in enumerate(procs)), ("coordinator", coordinator)]:
            console.say(f"nodeox launch: {name}: {_exit_status(p.returncode)}")
        sys.exit(128 + signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        pending = set(range(hosts))
        while pending:
            for i in sorted(pending):
                code = procs[i].poll()
                if code is None:
                    continue
                pending.discard(i)
                if code != 0:
                    others = "; the other hosts go on" if pending else ""
                    console.say(f"nodeox launch: host {i} failed: {_exit_status(code)}{others}")
                    status = status or (code if 0 < code < 256 else 1)
            if coordinator.poll() not in (None, 0) and pending:  # 0: the run completed, hosts are exiting
                console.say(f"nodeox launch: the coordinator failed (status {coordinator.returncode}); stopping the "
                            "hosts")
                status = status or 1
                _stop(procs)
                break
            time.sleep(0.1)
        try:
            coordinator.wait(30 if status == 0 else 5)  # it stops by itself once the run is complete
        except subprocess.TimeoutExpired:
            pass
        _stop([coordinator])
        for t in threads + coord_threads:
            t.join(5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    console.say(f"nodeox launch: {'done' if status == 0 else 'failed'}; run directory {run_dir} "
                f"(tensorboard --logdir {run_dir}, nodeox report {run_dir})")
    return status
