"""The package's rooms keep to their rules: host/ and coordinator/ never import each other, core/ imports
neither, and HTTP (requests, aiohttp, status numbers, header names) lives only in the two transport modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_nodeox"
TRANSPORTS = {"host/client.py", "coordinator/server.py"}
FORBIDDEN_ROOMS = {"host": {"coordinator", "tools"}, "coordinator": {"host", "tools"}, "core": {"host", "coordinator", "tools"}}


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


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """The checks above would fail for a host module importing the coordinator or requests."""
    bad = tmp_path / "lightning_nodeox" / "host" / "probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import requests\nfrom ..coordinator import rounds\n")
    names = imported(bad, root=tmp_path / "lightning_nodeox")
    assert "requests" in names and "lightning_nodeox.coordinator.rounds" in names
