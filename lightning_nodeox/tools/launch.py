"""``nodeox launch``: a coordinator and N host processes on this machine, outputs streamed with a prefix.

What starts is a :class:`~.topology.Topology`: with ``--sites S`` (S > 1) the run is shaped as sites, to try relays
on one machine (the coordinator as the root of S relays, the hosts spread over them; a host keeps its id, run folder
and CPU share, and joins its relay). Each process's environment, and where each host runs (its GPUs, its CPU
share), come from :mod:`.environments`; a host of several GPUs runs ``Trainer(devices=K)``, and Lightning starts
its other ranks (they share the host's output prefix and CPU share). The processes are watched to their end by
:mod:`.supervision`.

Outputs are shown line by line with a prefix (``[host 2]``, or ``[site 1 host 2]`` and ``[relay 1]`` with sites),
as a terminal would have shown them (:mod:`.console`): a progress bar in its last state, never its refreshes or
escape sequences; stdout and stderr read apart, so lines never run together; Lightning's start-up chatter and Python
warnings that every host prints alike shown once per launch.

Ctrl-C (SIGINT) or SIGTERM stops the run, resumable: the same command started again resumes it.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import replace
from pathlib import Path

from ..coordinator.config import CoordinatorConfig
from ..core.settings import RUN_DIR_TOKEN
from .console import Console
from .environments import Environments, Placement
from .supervision import Child, Server, Supervisor
from .topology import Topology

NODEOX = [sys.executable, "-m", "lightning_nodeox"]


def launch(config: CoordinatorConfig, coordinator_args: list[str], command: list[str], gpus_per_host: int = 1,
           sites: int = 1, relay_args: list[str] | None = None) -> int:
    """Run a coordinator (``nodeox coordinator COORDINATOR_ARGS``, the command line ``config`` was read from) and
    ``config.hosts`` copies of ``command``; with ``sites`` > 1, that many relays (``nodeox relay RELAY_ARGS``)
    between them; returns the exit status."""
    if not command:
        print("nodeox launch: give the host command after --, e.g. "
              "nodeox launch --hosts 2 --run-dir runs/demo -- python examples/finetune_vit.py", file=sys.stderr)
        return 2
    run_dir = Path(config.run_dir)
    topology = Topology.of(config.hosts, sites, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.token is None:
        config, coordinator_args, relay_args = _with_token(config, coordinator_args, relay_args or [], run_dir)
    environments, console = Environments(config), Console()
    servers = _start_servers(topology, environments, coordinator_args, relay_args or [], run_dir, console)
    if servers is None:
        return 1
    coordinator, relays = servers
    hosts = _start_hosts(topology, environments, command, gpus_per_host, coordinator, relays, console)
    status = Supervisor(console, coordinator, relays, [site.hosts for site in topology.relays], hosts,
                        topology.stop_order).run()
    ended = coordinator.proc.returncode  # 0: the run completed; 1: it stopped saved (the launch's outcome)
    outcome = {0: "done, the run completed", 1: "stopped before the run completed; the run is saved and the same "
               "command resumes it"}.get(ended, "failed")
    if ended in (0, 1) and status not in (0, ended):
        outcome += " (a process of the launch failed on the way, said above)"  # and its status is the launch's
    elif ended in (0, 1):
        status = ended
    console.say(f"nodeox launch: {outcome}; run directory {run_dir} "
                f"(tensorboard --logdir {run_dir}, nodeox report {run_dir}, nodeox status {run_dir})")
    return status


def _with_token(config: CoordinatorConfig, coordinator_args: list[str], relay_args: list[str],
                run_dir: Path) -> tuple[CoordinatorConfig, list[str], list[str]]:
    """A launch given no ``--token-file`` makes one (``RUN_DIR/token``, kept for a resume): its coordinator, relays
    and hosts use it, the status page's printed link carries it and ``nodeox status RUN_DIR`` reads it."""
    path = run_token(run_dir)
    flags = ["--token-file", str(path)]
    return (replace(config, token=path.read_text().strip()), [*coordinator_args, *flags],
            [*relay_args, *flags, "--upstream-token-file", str(path)])


def run_token(run_dir: Path, token: str | None = None) -> Path:
    """``RUN_DIR/token`` (owner-only), made once and kept for a resume: ``token`` when given, else a new one; a
    file that holds a token already is left as it is unless ``token`` differs."""
    path = run_dir / RUN_DIR_TOKEN
    held = path.read_text().strip() if path.exists() else ""
    if not held or (token is not None and token != held):
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(token or secrets.token_urlsafe(32))
    return path


def _start_servers(topology: Topology, environments: Environments, coordinator_args: list[str],
                   relay_args: list[str], run_dir: Path, console: Console) -> tuple[Server, list[Server]] | None:
    """The coordinator, then the relays (started together, then waited for), each serving; None (all stopped,
    the one that did not start named) otherwise."""
    coordinator = Server("coordinator", [*NODEOX, "coordinator", *topology.root_args(coordinator_args)],
                         environments.coordinator(), run_dir / ".coordinator-url", console)
    relays: list[Server] = []
    if coordinator.wait_ready() is not None:
        relays = [Server(site.name, [*NODEOX, *site.args(coordinator.url, relay_args)], environments.relay(),
                         site.ready_file, console) for site in topology.relays]
        for relay in relays:
            if relay.wait_ready() is None:
                break
    servers = [coordinator, *relays]
    failed = next((s for s in servers if s.url is None), None)
    if failed is None:
        return coordinator, relays
    for s in reversed(servers):
        s.stop()
    print(f"nodeox launch: the {failed.name} did not start (see its output above)", file=sys.stderr)
    return None


def _start_hosts(topology: Topology, environments: Environments, command: list[str], gpus_per_host: int,
                 coordinator: Server, relays: list[Server], console: Console) -> list[Child]:
    """The hosts, each joining at its coordinator's or relay's URL, on its share of this machine."""
    placement = Placement.of(topology.hosts, gpus_per_host)
    if placement.note is not None:
        console.say(placement.note)
    relay_urls = [relay.url for relay in relays]
    hosts = []
    for i in range(topology.hosts):
        url = topology.host_url(i, coordinator.url, relay_urls)
        env = environments.host(i, url, placement, reaches_the_root=topology.hosts_reach_the_root)
        hosts.append(Child(topology.host_name(i), command, env, console, placement.cpus[i]))
    return hosts
