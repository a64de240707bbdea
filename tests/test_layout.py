"""The package's rooms keep to their rules: host/ and coordinator/ never import each other (nor relay/, which
may import both), core/ imports none of them, HTTP (requests, aiohttp, status numbers, header names) lives only in the two transport modules, no room's
modules import each other in a circle, and the coordinator's transports reach the run only through its
lifecycle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_nodeox"
TRANSPORTS = {"host/client.py", "coordinator/server.py"}
FORBIDDEN_ROOMS = {"host": {"coordinator", "relay", "tools"}, "coordinator": {"host", "relay", "tools"},
                   "core": {"host", "coordinator", "relay", "tools"}, "relay": {"tools"}}
ROOMS = ("coordinator", "host", "core", "relay", "tools")
# what a coordinator transport may import of the coordinator: its service (every operation of the protocol), its
# settings and the limits of what is taken from the network (bodies, connections), and the status page's files;
# never the round's logic itself
TRANSPORT_MAY_IMPORT = {"service", "config", "intake", "connections", "statuspage"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported(path: Path, root: Path = PACKAGE) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved within the package)."""
    tree = ast.parse(path.read_text())
    package = ["lightning_nodeox", *path.relative_to(root).parent.parts]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_rooms_import_only_what_they_may(path: Path) -> None:
    names = imported(path)
    for other in FORBIDDEN_ROOMS.get(room(path), ()):
        assert not any(n.startswith(f"lightning_nodeox.{other}") for n in names), \
            f"{path.relative_to(PACKAGE)} imports from {other}/"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_http_lives_only_in_the_transports(path: Path) -> None:
    rel = str(path.relative_to(PACKAGE))
    if rel in TRANSPORTS:
        return
    names = imported(path)
    assert not any(n.split(".")[0] in ("requests", "aiohttp", "urllib3", "http") for n in names), \
        f"{rel} imports an HTTP library"
    if rel == "core/protocol.py":
        return  # the protocol itself names routes, headers and the status of each reason
    source = path.read_text()
    assert not re.search(r"X-Nodeox|status_code|\bstatus=\d{3}\b", source), f"{rel} speaks HTTP"


@pytest.mark.parametrize("path", sorted((PACKAGE / "relay").glob("*.py")), ids=lambda p: p.name)
def test_a_relay_is_a_plain_process_without_lightning(path: Path) -> None:
    """A relay imports the host's client and round, never Lightning (a plain aiohttp + PyTorch process)."""
    modules = {name for name in imported(path) if name.startswith("lightning_nodeox.host.")}
    assert not any(n.split(".")[0] == "lightning" for n in imported(path))
    for module in {".".join(n.split(".")[:3]) for n in modules}:
        source = PACKAGE / "host" / f"{module.rsplit('.', 1)[1]}.py"
        if source.exists():
            assert not any(n.split(".")[0] == "lightning" for n in imported(source)), f"{path.name} -> {module}"


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The checks above would fail for a host module importing the coordinator or requests."""
    bad = tmp_path / "lightning_nodeox" / "host" / "probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import requests\nfrom ..coordinator import rounds\n")
    names = imported(bad, root=tmp_path / "lightning_nodeox")
    assert "requests" in names and "lightning_nodeox.coordinator.rounds" in names


def module_name(path: Path, root: Path = PACKAGE) -> str:
    return ".".join(["lightning_nodeox", *path.relative_to(root).with_suffix("").parts])


def imports_within(room_dir: Path, root: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of a room (by its last name) -> the modules of the same room it imports (at any level of
    the file: inside functions and ``if TYPE_CHECKING:`` too)."""
    paths = {module_name(p, root): p for p in sorted(room_dir.glob("*.py")) if p.name != "__init__.py"}
    return {name.rsplit(".", 1)[1]: {n.rsplit(".", 1)[1] for n in imported(path, root) if n in paths and n != name}
            for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


@pytest.mark.parametrize("room_name", ROOMS)
def test_no_room_imports_itself_in_a_circle(room_name: str) -> None:
    graph = imports_within(PACKAGE / room_name)
    assert len(graph) > 2  # the room was found and read
    cycle = find_cycle(graph)
    assert cycle is None, f"{room_name}/ imports in a circle: {' -> '.join(cycle)}"


def coordinator_imports(path: Path, root: Path = PACKAGE, package: Path = PACKAGE) -> set[str]:
    """The coordinator modules (last names) that ``path`` imports (``root``: the folder its relative imports are
    resolved in; ``package``: the package whose coordinator/ is looked at)."""
    prefix = "lightning_nodeox.coordinator."
    folder = package / "coordinator"
    modules = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    assert modules, f"no coordinator modules under {package}"
    return {n[len(prefix):].split(".")[0] for n in imported(path, root) if n.startswith(prefix)} & modules


def test_the_server_imports_nothing_of_the_coordinator_but_its_service() -> None:
    imports = coordinator_imports(PACKAGE / "coordinator" / "server.py")
    assert "service" in imports
    assert imports <= TRANSPORT_MAY_IMPORT, f"server.py imports {sorted(imports - TRANSPORT_MAY_IMPORT)}"


RELAY_MAY_IMPORT = {"service", "config", "server"}  # the coordinator's face, its settings, the HTTP it serves over


@pytest.mark.parametrize("path", sorted((PACKAGE / "relay").glob("*.py")), ids=lambda p: p.name)
def test_a_relay_imports_nothing_of_the_coordinator_but_its_service(path: Path) -> None:
    imports = coordinator_imports(path)
    assert imports <= RELAY_MAY_IMPORT, f"relay/{path.name} imports coordinator {sorted(imports - RELAY_MAY_IMPORT)}"


def test_the_in_process_transport_calls_the_same_service() -> None:
    tests = Path(__file__).resolve().parent
    imports = coordinator_imports(tests / "local_transport.py", root=tests)
    assert "service" in imports
    assert imports <= TRANSPORT_MAY_IMPORT, f"local_transport.py imports {sorted(imports - TRANSPORT_MAY_IMPORT)}"


def test_the_layout_checks_see_a_circle_and_a_server_reaching_past_the_lifecycle(tmp_path: Path) -> None:
    root = tmp_path / "lightning_nodeox"
    (root / "coordinator").mkdir(parents=True)
    (root / "coordinator" / "a.py").write_text("from .b import B\n")
    (root / "coordinator" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                "    from .a import A\n")
    (root / "coordinator" / "server.py").write_text("from . import service\nfrom .rounds import Rounds\n")
    for name in ("service", "rounds"):
        (root / "coordinator" / f"{name}.py").write_text("")
    assert find_cycle(imports_within(root / "coordinator", root)) == ["a", "b", "a"]
    assert coordinator_imports(root / "coordinator" / "server.py", root, root) - TRANSPORT_MAY_IMPORT == {"rounds"}
    local = tmp_path / "local_transport.py"  # a test transport, outside the package, reaching past the service
    local.write_text("from lightning_nodeox.coordinator.service import embed\n"
                     "from lightning_nodeox.coordinator.rounds import Rounds\n")
    assert coordinator_imports(local, tmp_path) - TRANSPORT_MAY_IMPORT == {"rounds"}
    (root / "coordinator" / "service").mkdir()
    (root / "coordinator" / "service" / "__init__.py").write_text("")
    (root / "relay").mkdir()
    (root / "relay" / "close.py").write_text("from ..coordinator.service import SiteControl\n"
                                             "from ..coordinator.rounds import Rounds\n")
    assert coordinator_imports(root / "relay" / "close.py", root, root) - RELAY_MAY_IMPORT == {"rounds"}


@pytest.mark.slow
def test_the_nodeox_command_checks_its_flags_without_importing_torch(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_nodeox", "coordinator", "--hosts", "0",
                           "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert (done.returncode, done.stderr.splitlines()[-1]) == (1, "nodeox: --hosts must be at least 1, got 0")
    assert "lightning_nodeox.tools.cli" in loaded
    assert sorted(m for m in loaded if m.split(".")[0] in ("torch", "lightning")) == []
