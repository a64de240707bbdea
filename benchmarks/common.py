"""What the benchmarks share: starting and stopping their processes, a coordinator's URL once it listens, a
run's events, a timm model's shapes, this process's memory, and their samples written as they finish
(`SampleLog`). (CPU shares: `nodeox launch`'s own
`lightning_nodeox.tools.environments.cpu_shares`.)

A benchmark imports the package and this module (``python benchmarks/x.py`` puts benchmarks/ on the path),
never another benchmark; it runs another benchmark's file as a process where it needs one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def process_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: unbuffered output, one OpenMP thread, plus ``extra``."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


def coordinator_command(hosts: int, run_dir: Path, ready: Path, *args: str, bind: str = "127.0.0.1:0") -> list[str]:
    """`nodeox coordinator` for ``hosts`` hosts on ``bind`` (default 127.0.0.1 port 0), writing its URL to
    ``ready``."""
    return [sys.executable, "-m", "lightning_nodeox", "coordinator", "--hosts", str(hosts), "--run-dir",
            str(run_dir), "--bind", bind, "--ready-file", str(ready), *args]


def beside(run_dir: Path, what: str) -> Path:
    """A folder beside a coordinator's run directory (``near-logs`` beside ``near``): at its start the coordinator
    moves whatever it finds in its run directory aside, logs and host outputs too."""
    return run_dir.with_name(f"{run_dir.name}-{what}")


def spawn(cmd: list[str], log: Path | None, *, env: dict[str, str] | None = None, cpus: list[int] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` (environment: `process_env()` unless given), its output to ``log`` (None: discarded), in a
    process group of its own (so that `stop` ends whatever it starts too), pinned to ``cpus`` where given and
    allowed."""
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    try:
        proc = subprocess.Popen(cmd, env=env if env is not None else process_env(), cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        if log is not None:
            out.close()
    if cpus:
        try:
            os.sched_setaffinity(proc.pid, cpus)
        except OSError:
            pass
    return proc


def stop(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM each process group started, then SIGKILL what is left of it after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # also any child left in the group
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def wait_all(procs: list[subprocess.Popen], timeout: float, give_up=lambda: False) -> list[int | None]:
    """Exit statuses once every process has ended, one has failed, or ``give_up()`` is true."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and not give_up():
        if time.monotonic() > deadline:
            raise TimeoutError(f"run did not finish within {timeout:.0f} s")
        if any(p.returncode not in (None, 0) for p in procs):  # one failed: do not wait for the others' timeouts
            break
        time.sleep(0.1)
    return [p.poll() for p in procs]


def wait_ready(ready: Path, coordinator: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The URL the coordinator wrote to ``ready``; raises with the tail of its ``log`` if it ended or took longer
    than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (ready.exists() and ready.read_text().strip()):
        if coordinator.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"coordinator did not start:\n{tail(log, 40)}")
        time.sleep(0.05)
    return ready.read_text().strip()


def tail(path: Path, n: int = 15) -> str:
    """The last ``n`` lines of a log ("" when there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_events(run_dir: Path) -> list[dict]:
    """The run's events.jsonl, one dict a record."""
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def model_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The floating-point tensors of timm model ``name`` (built on the meta device: no memory, no weights)."""
    import timm
    import torch

    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items() if t.is_floating_point()]


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def relay_command(upstream: str, hosts: int, run_dir: Path, ready: Path, *args: str) -> list[str]:
    """`nodeox relay` under ``upstream`` for ``hosts`` hosts on 127.0.0.1 port 0 (id: the run directory's name),
    writing its URL to ``ready``."""
    return [sys.executable, "-m", "lightning_nodeox", "relay", "--upstream", upstream, "--hosts", str(hosts),
            "--run-dir", str(run_dir), "--bind", "127.0.0.1:0", "--ready-file", str(ready), *args]


def run_async(run: Callable[[Path], Awaitable[dict]], run_dir: Path | None, name: str) -> dict:
    """``run(workdir)`` on an event loop, in ``run_dir`` (None: a temporary directory, removed after); SIGTERM
    cancels it (so the processes it started are stopped) and exits saying ``name`` was terminated."""

    async def cancellable(workdir: Path) -> dict:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run(workdir)

    try:
        if run_dir is not None:
            return asyncio.run(cancellable(run_dir))
        with tempfile.TemporaryDirectory(prefix=f"nodeox-{name}-") as tmp:
            return asyncio.run(cancellable(Path(tmp)))
    except asyncio.CancelledError:
        sys.exit(f"{name}: terminated")


@dataclass
class Sample:
    """One sample in `SampleLog.sample`: the block sets ``result``; ``failed`` says why it raised (None: it did not)."""

    result: Any = None
    failed: str | None = None


class SampleLog:
    """A benchmark's samples, each appended to a JSON-lines file as it finishes: ``{**key, "result": ...}``, or
    ``{**key, "failed": "Type: message"}`` for one that raised, after which the benchmark goes on to the next. A
    crash or a bad sample loses only the sample it was in; ``failures`` holds this run's failed samples for the
    report."""

    def __init__(self, name: str, path: Path | None = None) -> None:
        """Samples go to ``path`` (None: ``nodeox-NAME-TIME.jsonl`` in the temporary directory), named on stderr."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = path or Path(tempfile.gettempdir()) / f"nodeox-{name}-{stamp}.jsonl"
        self.failures: list[dict] = []
        print(f"{name}: each sample is appended to {self.path} as it finishes", file=sys.stderr)

    @contextlib.contextmanager
    def sample(self, key: dict, unless: tuple[type[Exception], ...] = ()) -> Iterator[Sample]:
        """Around one sample (``key``: what names it): the block sets ``.result``, appended when it ends. An
        exception in the block is appended as the sample's failure, said on stderr and not raised further, unless
        it is one of ``unless`` (not a failed sample but an answer, such as "cannot run here": raised)."""
        taken = Sample()
        try:
            yield taken
        except unless:
            raise
        except Exception as e:  # noqa: BLE001 - whatever one sample raises, the next one runs
            taken.failed = f"{type(e).__name__}: {e}"
            self.failures.append({**key, "failed": taken.failed})
            self._append(self.failures[-1])
            print(f"{' '.join(map(str, key.values()))} failed, going on: {taken.failed}", file=sys.stderr)
        else:
            self._append({**key, "result": taken.result})

    def _append(self, line: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def failure_lines(failures: list[dict], results: str) -> list[str]:
    """The report's lines for `SampleLog.failures`: each failed sample's key and the first line of why (all of it
    in the ``results`` file)."""
    lines = [f"  failed: {' '.join(str(v) for k, v in f.items() if k != 'failed')}: "
             f"{f['failed'].splitlines()[0] if f['failed'] else '?'}" for f in failures]
    return lines + ([f"  (why in full: {results})"] if failures else [])


def add_results_option(p: argparse.ArgumentParser) -> None:
    """``--results FILE``: where `SampleLog` appends the samples."""
    p.add_argument("--results", type=Path,
                   help="append each sample to this JSON-lines file as it finishes (default: one in the temporary "
                        "directory, named on stderr at the start)")


async def interleaved(placements: list[str], repeats: int, run_one: Callable[[str, int], Awaitable[dict]],
                      skipped: dict[str, str], label: str, metrics: tuple[str, ...],
                      log: SampleLog) -> dict[str, list[dict]]:
    """``run_one(placement, repetition)`` for every placement in turn, ``repeats`` times (interleaved, so that
    what drifts on a shared machine drifts for all alike): ``{placement: [run, ...]}``. Each run goes to ``log``
    (``{"label": label, "placement": ..., "repeat": ...}``) as it ends; a run that fails is recorded there
    (``log.failures``) and the next one runs. A placement that cannot run here (``PlacementSkipped``) goes to
    ``skipped`` (placement -> why) and is not tried again."""
    from site_figures import PlacementSkipped

    runs: dict[str, list[dict]] = {p: [] for p in placements}
    for rep in range(repeats):
        for placement in placements:
            if placement in skipped:
                continue
            try:
                with log.sample({"label": label, "placement": placement, "repeat": rep},
                                unless=(PlacementSkipped,)) as taken:
                    taken.result = await run_one(placement, rep)
            except PlacementSkipped as e:
                skipped[placement] = str(e)
                continue
            if taken.failed:
                continue
            runs[placement].append(taken.result)
            print(f"{label} {placement} run {rep}: " + ", ".join(
                f"{m} {taken.result[m]:.4g}" for m in metrics if m in taken.result), file=sys.stderr)
    return runs
