"""The coordinator, or a relay, as a Ray actor: it supervises a ``python -m lightning_nodeox coordinator`` (or
``relay``) process, the same process ``nodeox launch`` starts (:class:`~lightning_nodeox.tools.supervision.Server`:
its ready file gives its URL, its output is the actor's, each line prefixed ``[coordinator]``).

A restart keeps the URL. The first start binds a free port and notes it in the run directory (``.ray-bind``, with
the driver's run id: a later run on the same directory picks a port anew); a restarted actor (Ray's
``max_restarts``; the driver pins the actor to its node) binds the same address again once the process of its
previous life is gone (the kernel sends it SIGTERM when the actor dies, so it saves the run; its lock on the run
directory says when it has gone). Hosts keep retrying the URL they were given (``retry_for``), so they need not
learn a new one, and the coordinator started again on its run directory (or ``--store``) resumes the run as
``nodeox coordinator`` always does.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from pathlib import Path

from ..coordinator.lock import LOCK_FILE  # the coordinator's and the relay's lock on their run directory
from ..tools.console import Console
from ..tools.supervision import Server
from .finalmodel import FinalModel
from .ports import free_port

BIND_FILE = ".ray-bind"
COORDINATOR = "coordinator"  # the root server's name (its process ends the run, and hands back the final model)
GONE_TIMEOUT = 60.0  # seconds a restarted server waits for the process of its previous life to let go


def wait_until_released(lock: Path, timeout: float = GONE_TIMEOUT) -> None:
    """Return once no process holds ``lock`` (a coordinator of a previous life still saving its run), or after
    ``timeout`` seconds (the new process then says who holds it)."""
    if not lock.exists():
        return
    deadline = time.monotonic() + timeout
    with open(lock, "a") as f:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                time.sleep(0.1)
                continue
            fcntl.flock(f, fcntl.LOCK_UN)
            return


class ServerActor:
    """One coordinator or relay process (``args``: its ``nodeox`` arguments, ``--bind`` left to this class) on run
    directory ``run_dir``, listening on ``bind_host`` (None: this Ray node's address). Made a Ray actor by the
    driver (:mod:`.driver`)."""

    def __init__(self, name: str, args: list[str], run_dir: str, ready_file: str, bind_host: str | None,
                 run_id: str) -> None:
        import ray

        self.name, self.run_dir, self.run_id = name, Path(run_dir), run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        bind = self._bind(bind_host or ray.util.get_node_ip_address())
        wait_until_released(self.run_dir / LOCK_FILE)
        command = [sys.executable, "-m", "lightning_nodeox", *args, "--bind", bind]
        self.server = Server(name, command, _environment(), Path(ready_file), Console(sys.stdout),
                             parent_death_signal=signal.SIGTERM)
        if self.server.wait_ready() is None:
            raise RuntimeError(f"the {name} did not start (exit status {self.server.proc.returncode}); its output "
                               f"is above, prefixed [{name}]")
        (self.run_dir / BIND_FILE).write_text(f"{run_id} {bind}")

    def __repr__(self) -> str:
        return f"nodeox-{self.name.replace(' ', '-')}"  # Ray's log prefix for this actor

    def _bind(self, host: str) -> str:
        """The address of a previous life of this actor (in this driver's run), else ``host`` and a free port."""
        path = self.run_dir / BIND_FILE
        noted = path.read_text().split() if path.exists() else []
        if len(noted) == 2 and noted[0] == self.run_id:
            return noted[1]
        return f"{host}:{free_port(host)}"

    def url(self) -> str:
        return self.server.url

    def wait(self) -> tuple[int, FinalModel | None]:
        """Wait for the process's end: its exit status, and the run's final model when the run completed
        (status 0) and this is the coordinator."""
        code = self.server.proc.wait()
        for t in self.server.threads:
            t.join(5)
        if code != 0 or self.name != COORDINATOR:
            return code, None
        return code, FinalModel.read(self.run_dir)


def _environment() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")
