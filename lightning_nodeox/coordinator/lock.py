"""One coordinator per run directory: an exclusive ``flock`` on ``DIR/coordinator.lock``, held for the
process's life (the kernel releases it when the process dies, kill -9 included). The file names its holder
(pid, host name, start time), so that a second coordinator refuses at once saying which one holds the run."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "coordinator.lock"


class RunDirBusy(ValueError):
    """Another live coordinator holds the run directory."""


class RunDirLock:
    """The held lock; keep the object for as long as the run directory is in use (closing it releases it)."""

    def __init__(self, run_dir: Path) -> None:
        self._fd: int | None = None
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirBusy(f"another coordinator holds {run_dir} ({holder}); stop it first, or give this one its "
                             "own --run-dir") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.time()}).encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says."""
    try:
        d = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(d["started"])))
        return f"pid {int(d['pid'])} on {d['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its pid is not written yet"
