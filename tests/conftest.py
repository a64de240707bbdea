"""Shared test helpers: a real coordinator process on 127.0.0.1 port 0, and `nodeox launch` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
HOSTS = Path(__file__).parent / "hosts"


class Coordinator:
    """A `nodeox coordinator` subprocess; stopped (and waited for) when the test ends."""

    def __init__(self, run_dir: Path, hosts: int, *args: str, timeout: float = 60) -> None:
        self.run_dir = run_dir
        ready = run_dir / "ready"
        ready.unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        n = len(list(run_dir.parent.glob(f"{run_dir.name}-coordinator*.log")))
        self.log_path = run_dir.parent / f"{run_dir.name}-coordinator{n}.log"  # outside: a new run moves records aside
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", str(hosts), "--run-dir", str(run_dir),
             "--bind", "127.0.0.1:0", "--ready-file", str(ready), "--threads", "1", *args],
            stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator did not start: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.url = ready.read_text().strip()

    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def coordinator(tmp_path):
    started: list[Coordinator] = []

    def start(hosts: int = 1, *args: str, run_dir: Path | None = None) -> Coordinator:
        c = Coordinator(run_dir or tmp_path / f"run{len(started)}", hosts, *args)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def launch(run_dir: Path, hosts: int, command: list[str], *coordinator_args: str, timeout: float = 240,
           env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`nodeox launch` a run on this machine (in ``cwd``), bounded by ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_nodeox", "launch", "--hosts", str(hosts), "--run-dir", str(run_dir),
         "--threads", "1", *coordinator_args, "--", *command],
        capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})))


def read_events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
