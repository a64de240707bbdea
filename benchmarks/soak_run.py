"""One soak run, from start to figures: the cluster started, its faults done at their rounds, the run ended once
it has published ``rounds`` rounds and every fault is over, then what it left read back and checked.

:func:`run` returns (and hands ``write`` as it goes) the run's figures: faults by kind, rounds published, lost and
redone, every host's final model against the root's last published one, held-out accuracy, goodput and its loss
by fault kind. ``problems`` lists every correctness check that failed and why the run did not end, if it did not
(empty: the run is whole).
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import soak_records as rec
from soak_cluster import Cluster, Settings, Topology
from soak_disk import Disk
from soak_faults import Injector
from soak_goodput import goodput
from soak_schedule import Fault

POLL_S = 0.1  # how often the root's round is read
DISK_BYTES = 64 << 20


def drive(cluster: Cluster, injector: Injector, faults: list[Fault], rounds: int, timeout: float) -> int:
    """Start each fault at its round (once its target is free), end it after its hold, and end the run (the stop
    file) once round ``rounds - 1`` is reached with every fault over. Returns the last round seen."""
    pending = sorted(faults, key=lambda f: f.at_round)
    deadline, seen = time.monotonic() + timeout, 0
    while True:
        r = cluster.round()
        seen = r if r is not None else seen
        injector.end_due(seen)
        for fault in [f for f in pending if f.at_round <= seen]:
            if not injector.busy(fault):
                pending.remove(fault)
                injector.start(fault, seen)
        failed = set(cluster.failed()) - injector.under_fault()
        if failed:
            raise RuntimeError(f"{', '.join(sorted(failed))} ended with an error at round {seen}; see "
                               f"{cluster.logs}")
        if seen >= rounds - 1 and not pending and not injector.active:
            cluster.stop_file.touch()
            return seen
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {seen} of {rounds} after {timeout:.0f} s; faults pending {len(pending)}, "
                               f"active {sorted(injector.active)}")
        time.sleep(POLL_S)


def wait_end(cluster: Cluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cluster.finished():
        if cluster.failed():
            raise RuntimeError(f"{', '.join(cluster.failed())} ended with an error at the run's end; see "
                               f"{cluster.logs}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the run did not end within {timeout:.0f} s of its stop")
        time.sleep(POLL_S)
    if cluster.failed():
        raise RuntimeError(f"{', '.join(cluster.failed())} ended with an error; see {cluster.logs}")


def run(workdir: Path, topology: Topology, settings: Settings, faults: list[Fault], rounds: int, python: list[str],
        write: Callable[[dict], None], timeout: float) -> dict:
    """One run under ``workdir``; the root's run directory on a tmpfs of its own where a fault fills its disk."""
    workdir.mkdir(parents=True, exist_ok=True)
    disk = Disk.mount(workdir / "rootfs", DISK_BYTES) if any(f.kind == "disk_full" for f in faults) else None
    cluster = Cluster(workdir, topology, settings, python, root_dir=disk.path / "root" if disk else None)
    injector = Injector(cluster, disk, write)
    started, last, failure = time.time(), -1, ""
    try:
        cluster.start()
        last = drive(cluster, injector, faults, rounds, timeout)
        wait_end(cluster, timeout=120)
    except (RuntimeError, TimeoutError) as e:  # what it measured is still read back, with why it stopped
        failure = f"the run did not end whole: {e}"
        write({"failure": failure})
    finally:
        cluster.close()
        if disk is not None:  # keep the root's records beside the others, then give the memory back
            shutil.copytree(cluster.root_dir, workdir / "root", dirs_exist_ok=True)
            disk.unmount()
    result = figures(workdir, topology, settings, injector.done, time.time() - started, last)
    result["problems"] += [failure] if failure else []
    return result


def figures(workdir: Path, topology: Topology, settings: Settings, faults: list[dict], wall_s: float,
            stopped_at: int) -> dict:
    """What the run left, read back and checked."""
    root = workdir / "root"
    published = rec.published(root)
    books = rec.ledgers(workdir / "hosts")
    rounds = rec.round_check(published, rec.taken(books))
    finals = rec.finals(workdir / "hosts", topology.hosts)
    last_hash = published[max(published)][-1] if published else None
    identical = all(f is not None and f["model_hash"] == last_hash for f in finals.values())
    accuracies = [f["accuracy"] for f in finals.values() if f is not None]
    gp = goodput(books, rec.contributors(root), set(published), faults, topology,
                 linger=settings.lease + 2.0)
    problems = [f"round(s) {rounds['lost']} never published" if rounds["lost"] else "",
                f"round(s) {rounds['redone']} published with two models" if rounds["redone"] else "",
                "" if identical else f"hosts' final models differ from the root's last ({last_hash}): "
                + ", ".join(f"{h}: {f['model_hash'] if f else 'none'}" for h, f in finals.items())]
    done = [f for f in faults if not f.get("skipped")]
    return {"seed": settings.seed, "wall_s": wall_s, "stopped_at": stopped_at,
            "faults": dict(Counter(f["kind"] for f in done)),
            "faults_skipped": [f"{f['kind']}: {f['skipped']}" for f in faults if f.get("skipped")],
            "overlapping": overlapping(done), "rounds": rounds, "final_hash": last_hash,
            "identical": identical, "hosts_final": finals,
            "accuracy": statistics.mean(accuracies) if accuracies else None,
            **gp, "problems": [p for p in problems if p]}


def overlapping(faults: list[dict]) -> int:
    """Faults that began while another was under way."""
    return sum(any(g is not f and g["start"] <= f["start"] < g["end"] for g in faults) for f in faults)
