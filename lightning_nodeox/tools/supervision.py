"""The processes of ``nodeox launch`` watched to their end: their output followed with a prefix (:mod:`.console`),
their exit statuses named, and a stop passed on in order.

A host that fails (exits non-zero, e.g. after a SIGTERM) is named at once; the others go on (as on a cluster: it
left, or its lease expires), and launch exits non-zero. A relay that fails stops its own hosts, the other sites go
on. If the coordinator fails, the hosts are stopped.

Ctrl-C (SIGINT) or SIGTERM stops the run, resumable: every child runs in a process group of its own, so the
terminal's SIGINT reaches launch alone; launch sends SIGTERM to the hosts (they leave and exit 143, without
tracebacks), then to the relays, then to the coordinator (each saves its run unfinished), and prints one line per
process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .console import Console

STOP_GRACE = 10.0  # seconds a process has to end after SIGTERM, before SIGKILL


def exit_status(code: int) -> str:
    """How a process ended, from its return code (negative: killed by a signal; 128+N: exited for signal N)."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        name = signal.Signals(number).name if number else ""
    except ValueError:
        name = ""
    return f"exit status {code}" + (f" ({name})" if name else "")


SERVER_ENDINGS = {0: "the run completed", 1: "stopped before the run completed, the run saved",
                  2: "could not start or resume its run"}  # a coordinator's (or relay's) exit statuses


def server_ending(code: int | None) -> str:
    """How a coordinator or relay ended, from its exit status (:data:`SERVER_ENDINGS`), status included."""
    if code in SERVER_ENDINGS:
        return f"{SERVER_ENDINGS[code]} ({exit_status(code)})"
    return exit_status(code) if code is not None else "still running"


def _dies_with_parent(signum: int | None):
    """A ``preexec_fn`` that has the kernel send ``signum`` to the child when the thread that started it ends
    (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing): a child of a process killed -9 (a Ray actor) does not outlive
    it. None: no ``preexec_fn``."""
    if signum is None or not sys.platform.startswith("linux"):
        return None

    def set_death_signal() -> None:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signum))  # 1: PR_SET_PDEATHSIG

    return set_death_signal


class Child:
    """A process of the launch, started in a process group of its own (a Ctrl-C in the terminal reaches launch,
    which forwards SIGTERM), pinned to ``cpus`` when given; its stdout and stderr followed, prefixed ``[name]``."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], console: Console,
                 cpus: list[int] | None = None, *, parent_death_signal: int | None = None) -> None:
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0,
                                     preexec_fn=_dies_with_parent(parent_death_signal))
        if cpus:
            try:
                os.sched_setaffinity(self.proc.pid, cpus)  # before the interpreter has started any thread of its own
            except OSError:
                pass
        self.threads = [threading.Thread(target=console.follow, args=(f"[{name}]", pipe), daemon=True)
                        for pipe in (self.proc.stdout, self.proc.stderr)]
        for t in self.threads:
            t.start()


def stop(children: list[Child]) -> None:
    """SIGTERM to every child still running, then SIGKILL to those still running after :data:`STOP_GRACE` s."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()


def ready_url(ready: Path) -> str:
    """The URL in a server's ``--ready-file``; "" while there is none (no file yet, or an empty one)."""
    try:
        return ready.read_text().strip()
    except FileNotFoundError:
        return ""


class Server(Child):
    """A coordinator or relay process of the launch; :meth:`wait_ready` until it serves."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], ready: Path, console: Console, *,
                 parent_death_signal: int | None = None) -> None:
        self.ready = ready
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        super().__init__(name, [*cmd, "--ready-file", str(ready)], env, console,
                         parent_death_signal=parent_death_signal)
        self.url: str | None = None

    def wait_ready(self, timeout: float = 120) -> str | None:
        """Its URL once it serves; None (it is stopped) if it exits or does not serve in ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not (url := ready_url(self.ready)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                return None
            time.sleep(0.05)
        self.url = url
        return url

    def stop(self) -> None:
        stop([self])
        for t in self.threads:
            t.join(5)


class Supervisor:
    """Watches a launch's hosts until each has ended, then its relays and coordinator; :meth:`run` returns launch's
    exit status. ``relays[k]`` serves the hosts ``blocks[k]``; a SIGINT or SIGTERM meanwhile stops the run."""

    def __init__(self, console: Console, coordinator: Server, relays: list[Server], blocks: list[tuple[int, ...]],
                 hosts: list[Child], stop_order: str) -> None:
        self.console, self.coordinator, self.relays, self.blocks = console, coordinator, relays, blocks
        self.hosts, self.stop_order = hosts, stop_order
        self.status = 0
        self._pending = set(range(len(hosts)))  # hosts still running
        self._failed_relays: set[int] = set()

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while self._pending and self._watch_once():
                time.sleep(0.1)
            self._wind_down()
            for t in self._threads():
                t.join(5)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return self.status

    def _fail(self, code: int = 1) -> None:
        self.status = self.status or code

    def _watch_once(self) -> bool:
        """One look at every process; False once the coordinator failed (the hosts are stopped)."""
        for i in sorted(self._pending):
            code = self.hosts[i].proc.poll()
            if code is None:
                continue
            self._pending.discard(i)
            if code != 0:
                others = "; the other hosts go on" if self._pending else ""
                self.console.say(f"nodeox launch: {self.hosts[i].name} failed: {exit_status(code)}{others}")
                self._fail(code if 0 < code < 256 else 1)
        for k, relay in enumerate(self.relays):
            left = self._pending & set(self.blocks[k])
            if k not in self._failed_relays and relay.proc.poll() not in (None, 0) and left:
                self._failed_relays.add(k)
                self.console.say(f"nodeox launch: relay {k} failed ({exit_status(relay.proc.returncode)}); stopping "
                                 "its hosts, the other sites go on")
                self._fail()
                stop([self.hosts[i] for i in left])
        coordinator = self.coordinator.proc
        if coordinator.poll() not in (None, 0) and self._pending:  # 0: the run completed, hosts are exiting
            self.console.say(f"nodeox launch: the coordinator ended: {server_ending(coordinator.returncode)}; "
                             "stopping the hosts")
            self._fail()
            stop(self.hosts)
            return False
        return True

    def _wind_down(self) -> None:
        """The relays, then the coordinator, end by themselves once the run is complete; waited for, then stopped."""
        for server in [*self.relays, self.coordinator]:
            try:
                server.proc.wait(30 if self.status == 0 else 5)
            except subprocess.TimeoutExpired:
                pass
            stop([server])
            if server.proc.returncode not in (0, None) and self.status == 0 and server is not self.coordinator:
                self.console.say(f"nodeox launch: {server.name} failed: {exit_status(server.proc.returncode)}")
                self.status = 1

    def _threads(self) -> list[threading.Thread]:
        return [t for c in [*self.hosts, self.coordinator, *self.relays] for t in c.threads]

    def _on_signal(self, signum: int, _frame) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)  # one stop at a time; it ends within 3 x STOP_GRACE
        self.console.say(f"nodeox launch: {signal.Signals(signum).name}: stopping {self.stop_order} (the run is "
                         "saved; the same command resumes it)")
        stop(self.hosts)  # first: they say goodbye while their coordinator listens
        stop(self.relays)  # then the relays: they leave the root
        stop([self.coordinator])
        for t in self._threads():
            t.join(5)
        for child in self.hosts:
            self.console.say(f"nodeox launch: {child.name}: {exit_status(child.proc.returncode)}")
        for server in [*self.relays, self.coordinator]:
            self.console.say(f"nodeox launch: {server.name}: {server_ending(server.proc.returncode)}")
        sys.exit(128 + signum)
