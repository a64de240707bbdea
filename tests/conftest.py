"""Fixtures shared by the test modules (what they share besides: helpers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(1)

from helpers import Coordinator, terminate  # noqa: E402 - after the path that finds it
from restarts import run  # noqa: E402
from s3server import s3_server, s3_url  # noqa: E402, F401 - fixtures: S3 in a thread, a bucket per test

from lightning_nodeox.core.phases import PhaseLog  # noqa: E402


class Zygote:
    """tests/zygote.py, the fork server behind tests/hosts/forked.py (it saves each host process ~5 s of imports):
    started with the session when slow tests run, its socket named in ``NODEOX_TEST_ZYGOTE`` once it listens
    (before the first slow test), stopped at the end. ``NODEOX_TEST_NO_ZYGOTE=1`` keeps it off."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="nodeox-zygote-"))
        self.socket = self.dir / "socket"
        self.log = open(self.dir / "zygote.log", "w")  # noqa: SIM115 - closed in stop(); never mixed with a test's
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "zygote.py"), str(self.socket)],
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test zygote did not start: {(self.dir / 'zygote.log').read_text()}")
            time.sleep(0.05)
        os.environ["NODEOX_TEST_ZYGOTE"] = str(self.socket)

    def stop(self) -> None:
        os.environ.pop("NODEOX_TEST_ZYGOTE", None)
        terminate(self.proc, 30)
        self.log.close()
        said = (self.dir / "zygote.log").read_text()
        if said:  # refusals (processes that ran by themselves) or a bad request: shown, never silent
            print(f"\n{said}", end="", file=sys.__stderr__)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def zygote(request):
    """The session's zygote, or None when no slow test runs or it is switched off."""
    wanted = os.environ.get("NODEOX_TEST_NO_ZYGOTE") != "1" and any(
        item.get_closest_marker("slow") for item in request.session.items)
    z = Zygote() if wanted else None
    yield z
    if z is not None:
        z.stop()


@pytest.fixture(autouse=True)
def zygote_ready(request, zygote) -> None:
    """A test that starts processes waits for the zygote to listen (unit tests run while it imports)."""
    if zygote is not None and request.node.get_closest_marker("slow"):
        zygote.ready()


@pytest.fixture
def coordinator(tmp_path):
    """Start `nodeox coordinator` processes: ``coordinator(hosts, *args, run_dir=...)``; all stopped at the end."""
    started: list[Coordinator] = []

    def start(hosts: int = 1, *args: str, run_dir: Path | None = None) -> Coordinator:
        c = Coordinator(run_dir or tmp_path / f"run{len(started)}", hosts, *args)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that takes the ``coordinator`` fixture starts a process: it is ``slow`` whether marked or not (the
    others that start processes carry the marker themselves)."""
    for item in items:
        if "coordinator" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def keep_records(monkeypatch):
    """Give every PhaseLog a list of the records it emitted (``host.phases.records``)."""
    original = PhaseLog.__init__

    def init(self, host: str) -> None:
        original(self, host)
        self.records = []
        self.listeners.append(self.records.append)

    monkeypatch.setattr(PhaseLog, "__init__", init)


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory):
    """The final model of a run never interrupted (restarts.run), per outer optimizer, frozen tensors and
    fragments: each run once a session (test_restart, test_persistence and test_store_takeover share them)."""
    hashes = {}

    def final(outer: tuple[str, ...], still: tuple[str, ...] = (), fragments: int = 1) -> str:
        if (outer, still, fragments) not in hashes:
            coord = Coordinator(tmp_path_factory.mktemp("reference") / "run", 2, *outer)
            try:
                a, b = run(coord.url, still=still, fragments=fragments)
                assert coord.wait(60) == 0
            finally:
                coord.stop()
            assert a == b
            hashes[outer, still, fragments] = a
        return hashes[outer, still, fragments]

    return final


@pytest.fixture(autouse=True)
def _stop_signals_not_ignored():
    """A process a test starts inherits an ignored SIGINT or SIGTERM (an ignored signal survives exec), and the
    forwarder of a forked process then does not pass it on: each test starts with neither ignored."""
    import signal

    for s, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if signal.getsignal(s) == signal.SIG_IGN:
            signal.signal(s, default)
    yield


@pytest.fixture
def local_coordinator(tmp_path):
    """Start in-process coordinators (tests/local_transport.py): ``local_coordinator(hosts, **config)``; all closed
    at the end."""
    from local_transport import LocalCoordinator

    started: list[LocalCoordinator] = []

    def start(hosts: int = 2, **config) -> LocalCoordinator:
        c = LocalCoordinator(tmp_path / f"run{len(started)}", hosts, **config)
        started.append(c)
        return c

    yield start
    for c in started:
        c.close()


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path) -> str:
    """The URL of an empty object store for a run (``--store``): a folder under tmp_path (``file://``), or a fresh
    bucket of a real S3-compatible server on 127.0.0.1 (tests/s3server.py). Every test of the store's rules takes
    it."""
    return f"file://{tmp_path / 'store'}" if request.param == "file" else request.getfixturevalue("s3_url")
