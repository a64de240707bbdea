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

With ``--sites S`` (S > 1) the run is shaped as sites, to try relays on one machine: the coordinator (the root,
``--hosts S``), S relays (``nodeox relay --upstream ROOT``, run directories ``RUN_DIR/sites/site<k>``, ids
``site<k>``) and the N hosts spread over them in blocks as even as possible (:func:`spread`); a host keeps its id,
run folder and CPU share, and its ``NODEOX_COORDINATOR_URL`` is its relay's. Prefixes name the site
(``[site 1 host 2]``, ``[relay 1]``); a relay that fails stops its own hosts, the other sites go on.

Ctrl-C (SIGINT) or SIGTERM stops the run, resumable: every child runs in a process group of its own, so the
terminal's SIGINT reaches launch alone; launch sends SIGTERM to the hosts (they leave and exit 143, without
tracebacks), then to the relays, then to the coordinator (each saves its run unfinished), and prints one line per
process. The same
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


def spread(hosts: int, sites: int) -> list[list[int]]:
    """The host ids of each site: consecutive blocks, sizes differing by at most one (the first sites the larger)."""
    if sites < 1:
        raise ValueError(f"--sites must be at least 1, got {sites}")
    if sites > hosts:
        raise ValueError(f"--sites {sites} is more than --hosts {hosts}: every site needs a host; give at most "
                         f"--sites {hosts}")
    per, extra = divmod(hosts, sites)
    sizes = [per + (k < extra) for k in range(sites)]
    return [list(range(sum(sizes[:k]), sum(sizes[: k + 1]))) for k in range(sites)]


def site_dir(run_dir: Path, site: int) -> Path:
    """The run directory of relay ``site`` (its name is the relay's id upstream)."""
    return run_dir / "sites" / f"site{site}"


class _Server:
    """A coordinator or relay process of the launch; :meth:`wait_ready` until it serves."""

    def __init__(self, name: str, cmd: list[str], env: dict, ready: Path, console: Console) -> None:
        self.name, self.ready = name, ready
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        self.proc, self.threads = _start([*cmd, "--ready-file", str(ready)], env, f"[{name}]", console)
        self.url: str | None = None

    def wait_ready(self, timeout: float = 120) -> str | None:
        """Its URL once it serves; None (it is stopped) if it exits or does not serve in ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                return None
            time.sleep(0.05)
        self.url = self.ready.read_text().strip()
        return self.url

    def stop(self) -> None:
        _stop([self.proc])
        for t in self.threads:
            t.join(5)


def launch(config: CoordinatorConfig, coordinator_args: list[str], command: list[str], gpus_per_host: int = 1,
           sites: int = 1, relay_args: list[str] | None = None) -> int:
    """Run a coordinator (``nodeox coordinator COORDINATOR_ARGS``, the command line ``config`` was read from) and
    ``config.hosts`` copies of ``command``; with ``sites`` > 1, that many relays (``nodeox relay RELAY_ARGS``)
    between them; returns the exit status."""
    hosts, run_dir, token, tls_cert = config.hosts, Path(config.run_dir), config.token, config.tls_cert
    if not command:
        print("nodeox launch: give the host command after --, e.g. "
              "nodeox launch --hosts 2 --run-dir runs/demo -- python examples/finetune_vit.py", file=sys.stderr)
        return 2
    blocks = spread(hosts, sites)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    nodeox = [sys.executable, "-m", "lightning_nodeox"]
    console = Console()
    root_args = coordinator_args if sites == 1 else [*coordinator_args, "--hosts", str(sites)]  # the last wins
    coordinator = _Server("coordinator", [*nodeox, "coordinator", *root_args], env, run_dir / ".coordinator-url",
                          console)
    servers = [coordinator]
    relays: list[_Server] = []
    if coordinator.wait_ready() is not None and sites > 1:
        relay_env = dict(env)
        if tls_cert is not None and ENV_CA_FILE not in os.environ:
            relay_env[ENV_CA_FILE] = str(Path(tls_cert).resolve())
        relays = [_Server(f"relay {k}", [*nodeox, "relay", "--upstream", coordinator.url, "--hosts", str(len(block)),
                                         "--run-dir", str(site_dir(run_dir, k)), "--bind", "127.0.0.1:0",
                                         *(relay_args or [])], relay_env, site_dir(run_dir, k) / ".relay-url", console)
                  for k, block in enumerate(blocks)]  # started together, then waited for
        for relay in relays:
            if relay.wait_ready() is None:
                break
    servers += relays
    failed = next((s for s in servers if s.url is None), None)
    if failed is not None:
        for s in reversed(servers):
            s.stop()
        print(f"nodeox launch: the {failed.name} did not start (see its output above)", file=sys.stderr)
        return 1
    gpus = _gpu_count()
    visible = gpu_sets(gpus, hosts, gpus_per_host)
    if 0 < gpus < hosts * gpus_per_host and "CUDA_VISIBLE_DEVICES" not in os.environ:
        console.say(f"nodeox launch: {gpus} GPUs for {hosts} hosts of {gpus_per_host}: every host sees every GPU")
    shares = cpu_shares(hosts)
    site_of = {i: k for k, block in enumerate(blocks) for i in block}
    names = {i: f"host {i}" if sites == 1 else f"site {site_of[i]} host {i}" for i in range(hosts)}
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    for i in range(hosts):
        url = coordinator.url if sites == 1 else relays[site_of[i]].url
        host_env = {**env, ENV_HOST_ID: str(i), ENV_LOCAL_RANK: str(i), ENV_NUM_HOSTS: str(hosts), ENV_URL: url,
                    ENV_RUN_DIR: str(run_dir)}
        if token:
            host_env[ENV_TOKEN] = token
        if tls_cert is not None and ENV_CA_FILE not in os.environ and sites == 1:  # relays serve their hosts plain
            host_env[ENV_CA_FILE] = str(Path(tls_cert).resolve())
        if visible[i] is not None and "CUDA_VISIBLE_DEVICES" not in os.environ:
            host_env["CUDA_VISIBLE_DEVICES"] = visible[i]
        if shares[i] is not None and "OMP_NUM_THREADS" not in os.environ:
            host_env["OMP_NUM_THREADS"] = str(len(shares[i]))
        proc, followers = _start(command, host_env, f"[{names[i]}]", console, shares[i])
        procs.append(proc)
        threads += followers
    every_thread = threads + [t for s in servers for t in s.threads]

    def forward(signum, _frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # one stop at a time; it ends within 3 x STOP_GRACE
        what = "the hosts, then the relays, then the coordinator" if relays else "the hosts, then the coordinator"
        console.say(f"nodeox launch: {signal.Signals(signum).name}: stopping {what} (the run is saved; the same "
                    "command resumes it)")
        _stop(procs)  # first: they say goodbye while their coordinator listens
        _stop([r.proc for r in relays])  # then the relays: they leave the root
        _stop([coordinator.proc])
        for t in every_thread:
            t.join(5)
        for name, p in [*((names[i], p) for i, p in enumerate(procs)), *((s.name, s.proc) for s in servers[1:]),
                        ("coordinator", coordinator.proc)]:
            console.say(f"nodeox launch: {name}: {_exit_status(p.returncode)}")
        sys.exit(128 + signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 0
    try:
        pending = set(range(hosts))
        failed_relays: set[int] = set()
        while pending:
            for i in sorted(pending):
                code = procs[i].poll()
                if code is None:
                    continue
                pending.discard(i)
                if code != 0:
                    others = "; the other hosts go on" if pending else ""
                    console.say(f"nodeox launch: {names[i]} failed: {_exit_status(code)}{others}")
                    status = status or (code if 0 < code < 256 else 1)
            for k, relay in enumerate(relays):
                left = pending & set(blocks[k])
                if k not in failed_relays and relay.proc.poll() not in (None, 0) and left:
                    failed_relays.add(k)
                    console.say(f"nodeox launch: relay {k} failed ({_exit_status(relay.proc.returncode)}); stopping "
                                "its hosts, the other sites go on")
                    status = status or 1
                    _stop([procs[i] for i in left])
            if coordinator.proc.poll() not in (None, 0) and pending:  # 0: the run completed, hosts are exiting
                console.say(f"nodeox launch: the coordinator failed (status {coordinator.proc.returncode}); stopping "
                            "the hosts")
                status = status or 1
                _stop(procs)
                break
            time.sleep(0.1)
        for s in servers[1:] + servers[:1]:  # they stop by themselves once the run is complete: relays first
            try:
                s.proc.wait(30 if status == 0 else 5)
            except subprocess.TimeoutExpired:
                pass
            _stop([s.proc])
            if s.proc.returncode not in (0, None) and status == 0 and s is not coordinator:
                console.say(f"nodeox launch: {s.name} failed: {_exit_status(s.proc.returncode)}")
                status = 1
        for t in every_thread:
            t.join(5)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    console.say(f"nodeox launch: {'done' if status == 0 else 'failed'}; run directory {run_dir} "
                f"(tensorboard --logdir {run_dir}, nodeox report {run_dir})")
    return status
