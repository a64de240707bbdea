"""The package's layout rules as checks. Each check takes a repository root (the folder holding
``lightning_nodeox/`` and ``tests/``) and returns the violations it finds there, one line each, named by path
relative to that root; ``tests/test_layout.py`` runs every check on this repository, and plants each violation in
a copy to see the same check catch it."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "lightning_nodeox"
COORDINATOR = f"{PACKAGE}.coordinator"
LOCAL_TRANSPORT = "tests/local_transport.py"

# the rooms (top folders of the package) a room's modules must not import
FORBIDDEN_ROOMS = {"host": {"coordinator", "relay", "tools", "ray"}, "coordinator": {"host", "relay", "tools", "ray"},
                   "core": {"host", "coordinator", "relay", "tools", "ray"}, "relay": {"tools", "ray"},
                   "tools": {"ray"}}  # ray/ (a run on Ray) starts what tools/ starts; nothing imports it
HTTP_LIBRARIES = {"requests", "aiohttp", "urllib3", "http"}
HTTP_MODULES = {f"{PACKAGE}/host/client.py", f"{PACKAGE}/coordinator/server.py",
                f"{PACKAGE}/host/placed.py"}  # the host's reads of the run's store (presigned GETs)
HTTP_WORDS = re.compile(r"X-Nodeox|status_code|\bstatus=\d{3}\b")
PROTOCOL = f"{PACKAGE}/core/protocol.py"  # the protocol itself names routes, headers and the status of each reason

MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60

# where the coordinator holds its parts and its state (CoordinatorRun's and RunState's attributes, and the sync a
# round makes): outside coordinator/, nothing assigns an attribute of an object reached through these names
COORDINATOR_PARTS = frozenset({"state", "rounds", "model", "membership", "recovery", "values", "watch", "hosts",
                               "making", "runlog"})
# the code that holds coordinator objects without being the coordinator: it may read them, never write them
STATE_READERS = (f"{PACKAGE}/relay", f"{PACKAGE}/host", f"{PACKAGE}/tools", LOCAL_TRANSPORT)


def package_modules(repo: Path) -> list[Path]:
    return sorted((repo / PACKAGE).rglob("*.py"))


def package_folders(repo: Path) -> list[str]:
    """Every folder of the package that is a package itself, relative to the package ("" for its own)."""
    folders = (p.parent.relative_to(repo / PACKAGE) for p in (repo / PACKAGE).rglob("__init__.py"))
    return sorted("" if folder == Path() else folder.as_posix() for folder in folders)


def module_name(path: Path, repo: Path) -> str:
    """The dotted name a module of the package is imported as (a package's ``__init__.py`` by the package's)."""
    parts = path.relative_to(repo).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path, repo: Path) -> str:
    """The package ``path``'s relative imports start from: "" for a file outside the package, such as
    tests/local_transport.py, a top-level module (tests/ is on ``sys.path``, not a package)."""
    parts = path.relative_to(repo).parent.parts
    return ".".join(parts) if parts and parts[0] == PACKAGE else ""


def import_nodes(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import of ``path``, at any level of the file: inside functions and ``if TYPE_CHECKING:`` too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` names (relative levels resolved within ``package``)."""
    parts = package.split(".") if package else []
    base = parts[: len(parts) - node.level + 1] if node.level else []
    return ".".join([*base, node.module] if node.module else base)


def imported(path: Path, repo: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, and of every name it takes from one (``a.b.Name``)."""
    package = package_of(path, repo)
    out = set()
    for node in import_nodes(path):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        else:
            name = from_module(node, package)
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def depends_on(path: Path, repo: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports: for ``from p import x``, the module ``p.x`` if it is one,
    else ``p`` (whose ``__init__`` defines ``x``); for ``import a.b``, ``a.b``."""
    package = package_of(path, repo)
    out = set()
    for node in import_nodes(path):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        else:
            name = from_module(node, package)
            out.update(f"{name}.{a.name}" if f"{name}.{a.name}" in known else name for a in node.names)
    return out & known


def relative(path: Path, repo: Path) -> str:
    return path.relative_to(repo).as_posix()


def in_package(path: Path, repo: Path) -> str:
    """``path`` relative to the package's folder (``host/client.py``), as the violations name modules."""
    return path.relative_to(repo / PACKAGE).as_posix()


def room(path: Path, repo: Path) -> str:
    parts = path.relative_to(repo / PACKAGE).parts
    return parts[0] if len(parts) > 1 else ""


def within(name: str, module: str) -> bool:
    """Whether the dotted ``name`` is ``module`` or something inside it."""
    return name == module or name.startswith(f"{module}.")


# ---- the rooms ----

def rooms_importing_what_they_may_not(repo: Path) -> list[str]:
    """A room's module importing a room it must not (``FORBIDDEN_ROOMS``)."""
    out = []
    for path in package_modules(repo):
        names = imported(path, repo)
        for other in sorted(FORBIDDEN_ROOMS.get(room(path, repo), ())):
            if any(within(n, f"{PACKAGE}.{other}") for n in names):
                out.append(f"{in_package(path, repo)} imports from {other}/")
    return out


def http_outside_the_transports(repo: Path) -> list[str]:
    """A module other than the two HTTP transports importing an HTTP library, or naming a header or a status."""
    out = []
    for path in package_modules(repo):
        if relative(path, repo) in HTTP_MODULES:
            continue
        if any(n.split(".")[0] in HTTP_LIBRARIES for n in imported(path, repo)):
            out.append(f"{in_package(path, repo)} imports an HTTP library")
        if relative(path, repo) != PROTOCOL and HTTP_WORDS.search(path.read_text()):
            out.append(f"{in_package(path, repo)} speaks HTTP")
    return out


def lightning_in_a_relay(repo: Path) -> list[str]:
    """A relay module importing Lightning, or a module of host/ that does (a relay is a plain process)."""
    out = []
    for path in sorted((repo / PACKAGE / "relay").glob("*.py")):
        names = imported(path, repo)
        if any(n.split(".")[0] == "lightning" for n in names):
            out.append(f"{in_package(path, repo)} imports Lightning")
        for module in sorted({".".join(n.split(".")[:3]) for n in names if within(n, f"{PACKAGE}.host")}):
            source = repo / PACKAGE / "host" / f"{module.rsplit('.', 1)[1]}.py"
            if source.exists() and any(n.split(".")[0] == "lightning" for n in imported(source, repo)):
                out.append(f"{in_package(path, repo)} imports {in_package(source, repo)}, which imports Lightning")
    return out


# ---- circles ----

def import_graph(repo: Path, folder: str | None = None) -> dict[str, set[str]]:
    """Each module of the package (or only of its ``folder``, not its subfolders) -> the modules of the same set
    it imports."""
    paths = [p for p in package_modules(repo) if folder is None or p.parent == repo / PACKAGE / folder]
    names = {module_name(p, repo): p for p in paths}
    return {name: depends_on(path, repo, set(names)) - {name} for name, path in names.items()}


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


def tangles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The sets of modules that reach each other through imports (strongly connected, more than one module), so
    that one circle found cannot hide another."""
    reach = {node: set() for node in graph}
    for node in graph:
        todo = list(graph[node])
        while todo:
            nxt = todo.pop()
            if nxt not in reach[node]:
                reach[node].add(nxt)
                todo.extend(graph.get(nxt, ()))
    out: list[set[str]] = []
    for node in sorted(graph):
        tangle = {node} | {other for other in reach[node] if node in reach[other]}
        if len(tangle) > 1 and tangle not in out:
            out.append(tangle)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of each tangle of ``graph``."""
    return [find_cycle({n: graph[n] & tangle for n in tangle}) for tangle in tangles(graph)]


def circle_in_folder(repo: Path, folder: str) -> list[str]:
    """A circle among the modules of one package folder (relative to the package, "" for its own), one for each
    tangle."""
    where = "/".join(filter(None, (PACKAGE, folder)))
    return [f"{where}/ imports in a circle: {' -> '.join(cycle)}" for cycle in circles(import_graph(repo, folder))]


def circle_in_the_package(repo: Path) -> list[str]:
    """A circle among all the package's modules, across folders, one for each tangle."""
    return [f"{PACKAGE} imports in a circle: {' -> '.join(cycle)}" for cycle in circles(import_graph(repo))]


# ---- what the coordinator's transports reach ----

def coordinator_modules(repo: Path) -> set[str]:
    """The coordinator's modules and subpackages, by last name."""
    folder = repo / PACKAGE / "coordinator"
    return {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}


def coordinator_imports(path: Path, repo: Path) -> set[str]:
    """The coordinator modules (last names) ``path`` imports; ``__init__`` for a name taken from the
    coordinator package itself."""
    known = coordinator_modules(repo)
    out = set()
    for name in imported(path, repo):
        if within(name, COORDINATOR) and name != COORDINATOR:
            first = name[len(COORDINATOR) + 1:].split(".")[0]
            out.add(first if first in known else "__init__")
    return out


def transports_reaching_past(repo: Path, may_import: dict[str, set[str]]) -> list[str]:
    """A transport importing a coordinator module other than those ``may_import`` allows it (keys: paths
    relative to ``repo``, a folder's for each of its modules), or a transport that is not there to be read."""
    out = []
    for where, allowed in may_import.items():
        target = repo / where
        paths = sorted(target.glob("*.py")) if target.is_dir() else [target] if target.exists() else []
        if not paths:
            out.append(f"{where} is missing")
        for path in paths:
            out.extend(f"{relative(path, repo)} imports coordinator/{m}"
                       for m in sorted(coordinator_imports(path, repo) - allowed))
    return out


# ---- who writes the coordinator's state ----

def target_chain(target: ast.expr) -> list[str]:
    """The names an assignment's target goes through: ``self.rounds.stable`` -> [self, rounds, stable];
    ``state.hosts[h]`` -> [state, hosts, "[]"] (an item of ``state.hosts`` is written)."""
    if isinstance(target, ast.Attribute):
        return [*target_chain(target.value), target.attr]
    if isinstance(target, ast.Subscript):
        return [*target_chain(target.value), "[]"]
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, ast.Call):
        return [*target_chain(target.func), "()"]
    return ["?"]


def assignment_targets(node: ast.AST) -> list[ast.expr]:
    """The targets an assignment writes, tuples and lists unpacked (an annotation without a value writes
    nothing)."""
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign) or isinstance(node, ast.AnnAssign) and node.value is not None:
        targets = [node.target]
    else:
        return []
    out = []
    while targets:
        target = targets.pop(0)
        if isinstance(target, (ast.Tuple, ast.List)):
            targets[:0] = target.elts
        elif isinstance(target, ast.Starred):
            targets.insert(0, target.value)
        else:
            out.append(target)
    return out


def state_readers(repo: Path) -> list[Path]:
    out = []
    for where in STATE_READERS:
        target = repo / where
        out.extend(sorted(target.rglob("*.py")) if target.is_dir() else [target])
    return out


def owner(chain: list[str]) -> list[str]:
    """The names of the object whose attribute a target's chain writes (for an item, the object holding the
    container): ``rounds.stable`` -> [rounds]; ``state.hosts[h]`` -> [state]; ``hosts[h]`` -> []."""
    while chain and chain[-1] == "[]":
        chain = chain[:-1]
    return chain[:-1]


def coordinator_state_written_outside(repo: Path) -> list[str]:
    """An assignment outside coordinator/ (in ``STATE_READERS``) to an attribute of an object reached through
    one of ``COORDINATOR_PARTS``, or to an item of such an attribute (``rounds.stable = True``,
    ``self.rounds.stable = True``, ``state.round += 1``, ``model.hash, model.latest_sync = ...``,
    ``state.hosts[h] = ...``)."""
    out = []
    for path in state_readers(repo):
        for node in ast.walk(ast.parse(path.read_text())):
            for target in assignment_targets(node):
                chain = target_chain(target)
                if COORDINATOR_PARTS & set(owner(chain)):
                    written = ".".join(chain).replace(".[]", "[]").replace(".()", "()")
                    out.append(f"{relative(path, repo)}:{node.lineno} writes {written}")
    return out


def attributes_set_in_coordinator(repo: Path) -> set[str]:
    """Every attribute name the coordinator's own code assigns on ``self``."""
    out = set()
    for path in (repo / PACKAGE / "coordinator").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            for target in assignment_targets(node):
                chain = target_chain(target)
                if len(chain) == 2 and chain[0] == "self":
                    out.add(chain[1])
    return out


# ---- sizes ----

def oversized(repo: Path) -> list[str]:
    """A class over ``MAX_CLASS_LINES`` lines or a function (a method, a nested one) over ``MAX_FUNCTION_LINES``
    lines in the package (from its ``class``/``def`` line to its last, decorators apart)."""
    out = []
    for path in package_modules(repo):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind, limit = "function", MAX_FUNCTION_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out.append(f"{in_package(path, repo)}: {kind} {node.name} has {lines} lines (at most {limit})")
    return out
