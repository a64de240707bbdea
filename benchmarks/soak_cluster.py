"""The soak's run as real processes on 127.0.0.1: a root coordinator, relays for sites and digits hosts
(benchmarks/soak_host.py), each of which can be killed -9, stopped, continued and started again as it was.

``Topology(relays, hosts_per_relay, direct)``: hosts ``0..`` behind relays ``relay0..`` (``hosts_per_relay``
each), then ``direct`` hosts that talk to the root. Each relay's upstream and each direct host reach the root
through a :class:`~soak_proxy.CutProxy` (the links the soak cuts). A process restarted binds the port it had, so
that whoever talks to it finds it again; the root resumes the run from its run directory.

``python``: how a Python process is started (``[sys.executable]``; the soak's test passes the test suite's forked
launcher, which skips importing torch again). Signals go to each process's own pid (its pid file, or
coordinator.json's), not the launcher's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from common import REPO, process_env, spawn, stop
from soak_proxy import CutProxy

HOST = Path(__file__).with_name("soak_host.py")


@dataclass(frozen=True)
class Topology:
    """Hosts behind relays and hosts straight to the root."""

    relays: int = 2
    hosts_per_relay: int = 2
    direct: int = 2

    @property
    def hosts(self) -> list[str]:
        return [str(h) for h in range(self.relays * self.hosts_per_relay + self.direct)]

    @property
    def relay_names(self) -> list[str]:
        return [f"relay{r}" for r in range(self.relays)]

    def relay_of(self, host: str) -> str | None:
        """The relay ``host`` is behind (None: it talks to the root)."""
        r = int(host) // self.hosts_per_relay
        return f"relay{r}" if r < self.relays else None


@dataclass(frozen=True)
class Settings:
    """What every run of the soak shares: lease, pacing, the training seed and the extra coordinator flags."""

    lease: float = 3.0
    local_steps: int = 10
    step_seconds: float = 0.03
    seed: int = 0
    coordinator_args: tuple[str, ...] = ()


class Cluster:
    """The processes of one run under ``workdir`` (the root's run directory may be elsewhere: ``root_dir``)."""

    def __init__(self, workdir: Path, topology: Topology, settings: Settings, python: list[str],
                 root_dir: Path | None = None) -> None:
        self.workdir, self.topology, self.settings, self.python = workdir, topology, settings, python
        self.root_dir = root_dir or workdir / "root"
        self.out, self.logs = workdir / "hosts", workdir / "logs"
        self.stop_file = workdir / "stop"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.proxies: dict[str, CutProxy] = {}  # "relay0" (its upstream) or a direct host's id
        self.starts: dict[str, int] = {}

    # -- starting -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """The root, its proxies, the relays, then every host."""
        for d in (self.out, self.logs, self.root_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.start_root()
        for link in [*self.topology.relay_names, *(h for h in self.topology.hosts if self.topology.relay_of(h) is None)]:
            self.proxies[link] = CutProxy(self.ports["root"])
            self.ports[f"proxy-{link}"] = self.proxies[link].start()
        for relay in self.topology.relay_names:
            self.start_relay(relay)
        for host in self.topology.hosts:
            self.start_host(host)

    def start_root(self) -> None:
        t = self.topology
        args = ["coordinator", "--hosts", str(t.relays + t.direct), "--run-dir", str(self.root_dir),
                "--lease", str(self.settings.lease), "--threads", "1", *self.settings.coordinator_args]
        self._start_server("root", args)

    def start_relay(self, relay: str) -> None:
        upstream = f"http://127.0.0.1:{self.ports[f'proxy-{relay}']}"
        args = ["relay", "--upstream", upstream, "--hosts", str(self.topology.hosts_per_relay), "--run-dir",
                str(self.workdir / relay), "--lease", str(self.settings.lease), "--threads", "1"]
        self._start_server(relay, args)

    def start_host(self, host: str) -> None:
        relay = self.topology.relay_of(host)
        port = self.ports[relay] if relay is not None else self.ports[f"proxy-{host}"]
        s = self.settings
        (self.out / f"host{host}.pid").unlink(missing_ok=True)
        cmd = [*self.python, str(HOST), "--out", str(self.out), "--stop-file", str(self.stop_file), "--seed",
               str(s.seed), "--local-steps", str(s.local_steps), "--step-seconds", str(s.step_seconds)]
        env = process_env(NODEOX_HOST_ID=host, NODEOX_COORDINATOR_URL=f"http://127.0.0.1:{port}")
        self._spawn(f"host{host}", cmd, env)

    def _start_server(self, name: str, args: list[str]) -> None:
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        bind = f"127.0.0.1:{self.ports.get(name, 0)}"
        self._spawn(name, [*self.python, "-m", "lightning_nodeox", *args, "--bind", bind, "--ready-file", str(ready)])
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text().strip()):
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start; see {self.logs / name}-*.log")
            time.sleep(0.05)
        self.ports[name] = int(ready.read_text().strip().rsplit(":", 1)[1])

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        n = self.starts.get(name, 0)
        self.starts[name] = n + 1
        self.procs[name] = spawn(cmd, self.logs / f"{name}-{n}.log", env=env, cwd=REPO)

    # -- faults ---------------------------------------------------------------------------------------------------
    def pid(self, name: str) -> int:
        """The process's own pid (not its launcher's): a host's pid file, a server's coordinator.json."""
        if name.startswith("host"):
            path = self.out / f"{name}.pid"
        else:
            path = (self.root_dir if name == "root" else self.workdir / name) / "coordinator.json"
        deadline = time.monotonic() + 60
        while True:
            try:
                return int(path.read_text()) if name.startswith("host") else json.loads(path.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} never wrote its pid to {path}") from None
                time.sleep(0.05)

    def kill(self, name: str) -> None:
        """kill -9 the process and wait until it (and its launcher) are gone."""
        _signal(self.pid(name), signal.SIGKILL)
        proc = self.procs[name]
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def pause(self, name: str) -> None:
        _signal(self.pid(name), signal.SIGSTOP)

    def resume(self, name: str) -> None:
        _signal(self.pid(name), signal.SIGCONT)

    def restart(self, name: str) -> None:
        if name == "root":
            self.start_root()
        elif name.startswith("relay"):
            self.start_relay(name)
        else:
            self.start_host(name.removeprefix("host"))

    # -- watching -------------------------------------------------------------------------------------------------
    def round(self) -> int | None:
        """The round the root is in (its status route), None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ports['root']}/v1/status", timeout=2) as r:
                return int(json.loads(r.read())["round"])
        except (OSError, ValueError, KeyError):
            return None

    def finished(self) -> bool:
        """Every process has ended."""
        return all(p.poll() is not None for p in self.procs.values())

    def failed(self) -> list[str]:
        """The processes that ended with a status other than 0."""
        return [name for name, p in self.procs.items() if p.poll() not in (None, 0)]

    def close(self) -> None:
        """Continue whatever is stopped, stop every process and proxy."""
        for name, p in self.procs.items():
            if p.poll() is None:
                try:
                    self.resume(name)
                except (RuntimeError, ProcessLookupError):
                    pass
        stop(list(self.procs.values()), grace=10)
        for proxy in self.proxies.values():
            proxy.close()


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
