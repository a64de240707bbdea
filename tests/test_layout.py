"""The package's layout, guarded. Each rule is a check in ``tests/layout_rules.py`` run here on this repository,
and each check is seen to catch its violation planted in a copy of the repository (the ``*_is_caught`` tests):

- Rooms: ``host/`` and ``coordinator/`` import neither each other nor ``relay/`` or ``tools/``; ``core/`` imports
  none of them; ``relay/`` does not import ``tools/`` (subfolders such as ``core/codecs/`` keep their room's rule).
- HTTP: only ``host/client.py`` and ``coordinator/server.py`` import an HTTP library (requests, aiohttp, urllib3,
  http); no other module but ``core/protocol.py`` names an ``X-Nodeox`` header, a ``status_code`` or a
  ``status=NNN``.
- A relay is a plain process: no ``relay/`` module imports Lightning, nor a ``host/`` module that does.
- Circles: no modules import each other in a circle, neither within any package folder (``core/codecs/`` and
  ``coordinator/outer/`` included) nor across the whole package; imports inside functions and under
  ``if TYPE_CHECKING:`` count.
- The coordinator's transports reach it through its service: ``coordinator/server.py`` imports of the
  coordinator only ``service``, ``config`` and its limits (intake, connections, statuspage);
  ``tests/local_transport.py`` only ``service`` and ``config``; every ``relay/`` module only ``service``,
  ``config`` and the server (with which it serves its hosts).
- The coordinator's state: no module of ``relay/``, ``host/``, ``tools/`` nor ``tests/local_transport.py``
  assigns an attribute of an object reached through a name the coordinator holds its parts under
  (``layout_rules.COORDINATOR_PARTS``: ``rounds.stable = True``, ``state.round = 3``, ``model.hash = h``), nor
  an item of such an attribute.
- Sizes (expected to fail until HostRound and HostTensors are split, issue 26): no class of the package over 300
  lines, no function over 60.
- The ``nodeox`` command checks its flags without importing torch or Lightning (slow)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from layout_rules import (COORDINATOR_PARTS, LOCAL_TRANSPORT, PACKAGE, attributes_set_in_coordinator,
                          circle_in_folder, circle_in_the_package, coordinator_imports,
                          coordinator_state_written_outside, http_outside_the_transports, import_graph,
                          lightning_in_a_relay, oversized, package_folders, rooms_importing_what_they_may_not,
                          transports_reaching_past)

REPO = Path(__file__).resolve().parents[1]
SERVER = f"{PACKAGE}/coordinator/server.py"
RELAY = f"{PACKAGE}/relay"
# what a transport may import of the coordinator: its service (every operation of the protocol) and its settings;
# the server also the limits of what it takes from the network (bodies, connections) and the status page's
# files, a relay the server it serves its hosts with; never the round's logic itself
THROUGH_THE_SERVICE = {SERVER: {"service", "config", "intake", "connections", "statuspage"},
                       LOCAL_TRANSPORT: {"service", "config"},
                       RELAY: {"service", "config", "server"}}


def planted(tmp_path: Path, check: Callable[[Path], list[str]], files: dict[str, str | None]) -> list[str]:
    """What ``check`` finds in a copy of this repository (the package and tests/local_transport.py) with ``files``
    planted (text appended to the file, or a new file; None removes it) that it does not find in this one."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / PACKAGE, copy / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "tests").mkdir()
    shutil.copy(REPO / LOCAL_TRANSPORT, copy / LOCAL_TRANSPORT)
    for name, text in files.items():
        path = copy / name
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text)
    before = set(check(REPO))
    return [v for v in check(copy) if v not in before]


def test_rooms_import_only_what_they_may() -> None:
    assert rooms_importing_what_they_may_not(REPO) == []


def test_a_room_importing_another_is_caught(tmp_path: Path) -> None:
    found = planted(tmp_path, rooms_importing_what_they_may_not, {
        f"{PACKAGE}/host/probe.py": "from ..coordinator import rounds\n",
        f"{PACKAGE}/core/codecs/probe.py": "def f():\n    from ...host.round import HostRound\n",
        f"{PACKAGE}/coordinator/outer/probe.py": "import lightning_nodeox.relay.run\n"})
    assert found == ["coordinator/outer/probe.py imports from relay/", "core/codecs/probe.py imports from host/",
                     "host/probe.py imports from coordinator/"]


def test_http_lives_only_in_the_transports() -> None:
    assert http_outside_the_transports(REPO) == []


def test_http_outside_the_transports_is_caught(tmp_path: Path) -> None:
    found = planted(tmp_path, http_outside_the_transports, {
        f"{PACKAGE}/host/probe.py": "import requests\n",
        f"{PACKAGE}/coordinator/rounds.py": "ROUND_HEADER = 'X-Nodeox-Round'\n",
        f"{PACKAGE}/relay/probe.py": "from aiohttp import web\n"})
    assert found == ["coordinator/rounds.py speaks HTTP", "host/probe.py imports an HTTP library",
                     "relay/probe.py imports an HTTP library"]


def test_a_relay_is_a_plain_process_without_lightning() -> None:
    assert lightning_in_a_relay(REPO) == []


def test_lightning_in_a_relay_is_caught(tmp_path: Path) -> None:
    found = planted(tmp_path, lightning_in_a_relay, {
        f"{PACKAGE}/relay/probe.py": "import lightning.pytorch as pl\n",
        f"{PACKAGE}/relay/upstream.py": "from ..host.probe import Module\n",
        f"{PACKAGE}/host/probe.py": "from lightning.pytorch import LightningModule as Module\n"})
    assert found == ["relay/probe.py imports Lightning", "relay/upstream.py imports host/probe.py, which imports "
                                                         "Lightning"]


@pytest.mark.parametrize("folder", package_folders(REPO), ids=lambda folder: folder or PACKAGE)
def test_no_package_folder_imports_itself_in_a_circle(folder: str) -> None:
    assert len(import_graph(REPO, folder)) >= 2  # the folder was found and read
    assert circle_in_folder(REPO, folder) == []


def test_no_modules_import_each_other_in_a_circle_across_the_package() -> None:
    graph = import_graph(REPO)
    assert sum(len(deps) for deps in graph.values()) > len(graph)  # the imports were read
    assert circle_in_the_package(REPO) == []


def test_a_circle_in_a_subfolder_is_caught(tmp_path: Path) -> None:
    """In ``core/codecs/``, closed by an import only for typing; in ``coordinator/outer/``, by one inside a
    function."""
    files = {f"{PACKAGE}/core/codecs/probe_a.py": "from .probe_b import B\n",
             f"{PACKAGE}/core/codecs/probe_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from .probe_a import A\n",
             f"{PACKAGE}/coordinator/outer/probe_a.py": "from . import probe_b\n",
             f"{PACKAGE}/coordinator/outer/probe_b.py": "def f():\n    from .probe_a import A\n"}
    circles = {}
    for folder in ("core/codecs", "coordinator/outer"):
        a, b = (f"{PACKAGE}.{folder.replace('/', '.')}.{name}" for name in ("probe_a", "probe_b"))
        circles[folder] = f"{a} -> {b} -> {a}"
        found = planted(tmp_path / folder, partial(circle_in_folder, folder=folder), files)
        assert found == [f"{PACKAGE}/{folder}/ imports in a circle: {circles[folder]}"]
    found = planted(tmp_path / "whole", circle_in_the_package, files)
    assert found == [f"{PACKAGE} imports in a circle: {circles[folder]}" for folder in sorted(circles)]


def test_a_circle_across_folders_is_caught(tmp_path: Path) -> None:
    """A circle through two folders, which neither folder's check sees, is the whole package's."""
    files = {f"{PACKAGE}/core/codecs/probe.py": "from ..probe import Outer\n",
             f"{PACKAGE}/core/probe.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from .codecs.probe import Inner\n"}
    for folder in package_folders(REPO):
        assert planted(tmp_path / (folder or "top"), partial(circle_in_folder, folder=folder), files) == []
    a, b = f"{PACKAGE}.core.codecs.probe", f"{PACKAGE}.core.probe"
    assert planted(tmp_path / "whole", circle_in_the_package, files) == [
        f"{PACKAGE} imports in a circle: {a} -> {b} -> {a}"]


def test_the_server_imports_nothing_of_the_coordinator_but_its_service() -> None:
    assert "service" in coordinator_imports(REPO / SERVER, REPO)
    assert transports_reaching_past(REPO, {SERVER: THROUGH_THE_SERVICE[SERVER]}) == []


def test_the_in_process_transport_calls_the_same_service() -> None:
    imports = coordinator_imports(REPO / LOCAL_TRANSPORT, REPO)
    assert {"service", "config"} <= imports  # read as the top-level module it is: not silently empty
    assert transports_reaching_past(REPO, {LOCAL_TRANSPORT: THROUGH_THE_SERVICE[LOCAL_TRANSPORT]}) == []


def test_a_relay_imports_nothing_of_the_coordinator_but_its_service() -> None:
    assert transports_reaching_past(REPO, {RELAY: THROUGH_THE_SERVICE[RELAY]}) == []


def test_a_transport_reaching_past_the_service_is_caught(tmp_path: Path) -> None:
    found = planted(tmp_path, partial(transports_reaching_past, may_import=THROUGH_THE_SERVICE), {
        SERVER: "from .rounds import Rounds\n",
        LOCAL_TRANSPORT: "from lightning_nodeox.coordinator.membership import Membership\n"})
    assert found == [f"{SERVER} imports coordinator/rounds", f"{LOCAL_TRANSPORT} imports coordinator/membership"]


def test_a_relay_reaching_past_the_service_or_a_missing_transport_is_caught(tmp_path: Path) -> None:
    found = planted(tmp_path, partial(transports_reaching_past, may_import=THROUGH_THE_SERVICE), {
        f"{PACKAGE}/relay/probe.py": "from ..coordinator import runstate\nfrom ..coordinator.outer import nesterov\n",
        LOCAL_TRANSPORT: None})
    assert found == [f"{LOCAL_TRANSPORT} is missing", f"{PACKAGE}/relay/probe.py imports coordinator/outer",
                     f"{PACKAGE}/relay/probe.py imports coordinator/runstate"]


def test_the_coordinator_parts_are_named_as_the_coordinator_holds_them() -> None:
    assert COORDINATOR_PARTS <= attributes_set_in_coordinator(REPO)


def test_only_the_coordinator_writes_its_state() -> None:
    assert coordinator_state_written_outside(REPO) == []


def test_a_write_to_the_coordinators_state_is_caught(tmp_path: Path) -> None:
    relay = f"{PACKAGE}/relay/probe.py"
    found = planted(tmp_path, coordinator_state_written_outside, {
        relay: ("def close(self, rounds, state, model, h):\n"
                "    rounds.stable = True\n"
                "    state.round = 3\n"
                "    model.hash = h\n"
                "    self.run.state.published_round += 1\n"
                "    state.hosts['h'] = None\n"
                "    model.hash, (model.latest_sync, x) = h, (None, 1)\n"
                "    hosts = {}\n"
                "    hosts['h'] = 1\n"  # a dict of its own
                "    self.model = model\n"),  # an attribute of its own
        f"{PACKAGE}/host/probe.py": "def f(run):\n    run.rounds.stable: bool = True\n",
        f"{PACKAGE}/tools/probe.py": "def f(state):\n    state.round -= 1\n",
        f"{PACKAGE}/coordinator/probe.py": "def f(state):\n    state.round = 3\n",  # the coordinator's own
        LOCAL_TRANSPORT: "\n\ndef f(run):\n    run.state.complete = True\n"})
    n = len((REPO / LOCAL_TRANSPORT).read_text().splitlines()) + 4
    assert found == [f"{PACKAGE}/relay/probe.py:{line} writes {target}" for line, target in (
        (2, "rounds.stable"), (3, "state.round"), (4, "model.hash"), (5, "self.run.state.published_round"),
        (6, "state.hosts[]"), (7, "model.hash"), (7, "model.latest_sync"))] + [
        f"{PACKAGE}/host/probe.py:2 writes run.rounds.stable", f"{PACKAGE}/tools/probe.py:2 writes state.round",
        f"{LOCAL_TRANSPORT}:{n} writes run.state.complete"]


def test_no_class_or_function_is_too_long_to_read_in_one_sitting() -> None:
    assert oversized(REPO) == []


def test_a_class_or_function_too_long_is_caught(tmp_path: Path) -> None:
    def function(name: str, lines: int) -> str:
        return f"def {name}():\n" + "    x = 0\n" * (lines - 1)

    def method(name: str, lines: int) -> str:
        return "".join(f"    {line}\n" for line in function(name, lines).splitlines())

    found = planted(tmp_path, oversized, {
        f"{PACKAGE}/core/probe.py": function("long", 61) + function("short", 60) + "\n\n@dataclass\nclass Long:\n"
        + method("a", 60) * 5,  # 301 lines, decorator apart
        f"{PACKAGE}/coordinator/outer/probe.py": "class Short:\n" + method("a", 61) + method("b", 57) * 4,
        f"{PACKAGE}/host/probe.py": "def outer():\n    " + function("inner", 61).replace("\n", "\n    ")})
    assert found == ["coordinator/outer/probe.py: function a has 61 lines (at most 60)",
                     "core/probe.py: function long has 61 lines (at most 60)",
                     "core/probe.py: class Long has 301 lines (at most 300)",
                     "host/probe.py: function outer has 62 lines (at most 60)",
                     "host/probe.py: function inner has 61 lines (at most 60)"]


@pytest.mark.slow
def test_the_nodeox_command_checks_its_flags_without_importing_torch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_nodeox", "coordinator", "--hosts", "0",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert (done.returncode, done.stderr.splitlines()[-1]) == (1, "nodeox: --hosts must be at least 1, got 0")
    assert "lightning_nodeox.tools.cli" in loaded
    assert sorted(m for m in loaded if m.split(".")[0] in ("torch", "lightning")) == []
