"""megacompile's import graph, read from the source with `ast` (nothing is imported), and the
rules it must keep: no import cycle, no import up the layer list of docs/architecture.md, no
reach into the Engine's private attributes from outside its room, no room left unplaced.

A module's room is the first name under `megacompile`: `megacompile.ir.program` is in `ir`,
`megacompile.errors` in `errors`; the package's own `__init__` and `__main__` are the rooms
`__init__` and `__main__`. kernels/ and passes/ install as megacompile.kernels and
megacompile.passes (pyproject.toml's package-dir) and are read as such.
"""
from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

PACKAGE = "megacompile"
# Folder of each top-level package name, relative to the repository root.
SOURCE_ROOTS = {PACKAGE: "megacompile", f"{PACKAGE}.kernels": "kernels", f"{PACKAGE}.passes": "passes"}


@dataclass(frozen=True)
class Site:
    path: Path
    line: int

    def __str__(self):
        return f"{self.path}:{self.line}"


@functools.lru_cache(maxsize=None)
def _parse_text(text: str, filename: str) -> ast.Module:
    return ast.parse(text, filename)


def parse(path: Path) -> ast.Module:
    """The file's syntax tree, parsed once per text (a copied tree shares its original's);
    read only."""
    return _parse_text(path.read_text(), path.name)


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package's name maps to its __init__)."""
    modules = {}
    for package, folder in SOURCE_ROOTS.items():
        base = root / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _resolve_from(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _known(target: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lands in: itself, or the nearest package holding it."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def imports_of(module: str, path: Path, modules: dict[str, Path]):
    """(target module, line) for every import in the file, wherever it stands: inside functions,
    under `if TYPE_CHECKING:`, and `importlib.import_module("megacompile....")` with a literal."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(parse(path)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                names.append(sub if sub in modules else base)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            names = [node.args[0].value]
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _known(name, modules)
                if target and target != module:
                    yield target, node.lineno


def build_graph(root: Path) -> nx.DiGraph:
    """Module graph: an edge a -> b when a imports b; edge attribute `sites` lists where."""
    root = Path(root)
    modules = find_modules(root)
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module, path=path.relative_to(root))
        for target, line in imports_of(module, path, modules):
            if not graph.has_edge(module, target):
                graph.add_edge(module, target, sites=[])
            graph.edges[module, target]["sites"].append(Site(path.relative_to(root), line))
    return graph


def room_of(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def layer_index(layers) -> dict[str, int]:
    return {room: i for i, rooms in enumerate(layers) for room in rooms}


def _first_site(graph, a, b) -> Site:
    return graph.edges[a, b]["sites"][0]


def _is_up(graph, a, b, where) -> bool:
    ra, rb = where.get(room_of(a)), where.get(room_of(b))
    return ra is not None and rb is not None and rb > ra


def import_cycles(graph: nx.DiGraph, layers=()) -> list[str]:
    """One message per strongly connected set of modules, naming cycles as paths. For each edge
    of the set that goes up the layer list (the likely culprits) the shortest cycle through it
    is named; a set with no such edge names the shortest cycle through its first edge."""
    where = layer_index(layers)
    messages = []
    components = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    for component in sorted(components, key=lambda c: (-len(c), sorted(c))):
        sub = graph.subgraph(component)
        edges = sorted(sub.edges)
        chosen = [e for e in edges if _is_up(graph, *e, where)] or edges[:1]
        paths = []
        for a, b in chosen:
            back = nx.shortest_path(sub, b, a)
            paths.append(f"    {' -> '.join([a, *back])}   ({_first_site(graph, a, b)})")
        messages.append(f"import cycle among {len(component)} modules ({', '.join(sorted(component))}):\n"
                        + "\n".join(paths))
    return messages


def layer_violations(graph: nx.DiGraph, layers) -> list[str]:
    """Imports that go up the layer list, and rooms that import each other within one layer."""
    where = layer_index(layers)
    messages = []
    for a, b in sorted(graph.edges):
        if _is_up(graph, a, b, where):
            ra, rb = room_of(a), room_of(b)
            for site in graph.edges[a, b]["sites"]:
                messages.append(f"{site}: {a} (room {ra}, layer {where[ra]}) imports {b} "
                                f"(room {rb}, layer {where[rb]}): an import up the layer list")
    rooms = nx.DiGraph()
    for a, b in graph.edges:
        ra, rb = room_of(a), room_of(b)
        if ra != rb and ra in where and where.get(rb) == where[ra]:
            rooms.add_edge(ra, rb, site=_first_site(graph, a, b), modules=(a, b))
    cycles = [c[c.index(min(c)):] + c[:c.index(min(c))] for c in nx.simple_cycles(rooms)]
    for cycle in sorted(cycles):
        pairs = zip(cycle, cycle[1:] + cycle[:1])
        path = ", ".join(f"{rooms.edges[x, y]['modules'][0]} -> {rooms.edges[x, y]['modules'][1]} "
                         f"({rooms.edges[x, y]['site']})" for x, y in pairs)
        messages.append(f"rooms of layer {where[cycle[0]]} import each other in a cycle "
                        f"{' -> '.join(cycle + cycle[:1])}: {path}")
    return messages


def unplaced_rooms(root: Path, graph: nx.DiGraph, layers) -> list[str]:
    """Every package folder under megacompile/ (and kernels/, passes/ themselves), and every
    module's room, must stand in the layer list."""
    root = Path(root)
    placed = layer_index(layers)
    rooms = {"kernels", "passes"}
    rooms |= {p.parent.name for p in (root / SOURCE_ROOTS[PACKAGE]).glob("*/__init__.py")}
    found = {r: f"folder {SOURCE_ROOTS[PACKAGE]}/{r}/" for r in rooms}
    for module in graph.nodes:
        found.setdefault(room_of(module), f"module {module}")
    return [f"{what} is room {room!r}, which is in no layer of the layer list: place it in "
            f"docs/architecture.md's map and the test's LAYERS"
            for room, what in sorted(found.items()) if room not in placed]


# --- the Engine's private attributes ----------------------------------------------------------

def _engine_files(root: Path) -> list[Path]:
    package = root / SOURCE_ROOTS[PACKAGE] / "engine"
    if package.is_dir():
        return sorted(package.rglob("*.py"))
    return [root / SOURCE_ROOTS[PACKAGE] / "engine.py"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines: its methods `_x` and attributes assigned as `self._x`."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and _private(n.name)}
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self" and _private(t.attr)):
                    names.add(t.attr)
    return names


def engine_private_names(root: Path) -> set[str]:
    """The private names of class Engine (and of the classes of its room it derives from)."""
    classes = {}
    for path in _engine_files(Path(root)):
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    names, todo, seen = set(), ["Engine"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for cls in classes.get(name, []):
            names |= _self_assigned(cls)
            todo += [b.id for b in cls.bases if isinstance(b, ast.Name)]
    return names


def _own_private_names(tree: ast.AST) -> dict[ast.AST, set[str]]:
    """For each node inside a class, the private names that class defines for itself."""
    owner = {}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            names = _self_assigned(cls)
            for node in ast.walk(cls):
                owner.setdefault(node, set()).update(names)
    return owner


def engine_private_access(root: Path) -> list[str]:
    """`expr._x` (or getattr(expr, "_x")) with `_x` one of the Engine's private names, outside the
    engine's room, where expr is not self/cls and the class it stands in does not define `_x`."""
    root = Path(root)
    names = engine_private_names(root)
    inside = set(_engine_files(root))
    found = set()
    for path in find_modules(root).values():
        if path in inside:
            continue
        tree = parse(path)
        if not any(isinstance(n, ast.Attribute) and n.attr in names
                   or isinstance(n, ast.Constant) and n.value in names for n in ast.walk(tree)):
            continue
        own = _own_private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                subject, attr = node.value, node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                subject, attr = node.args[0], node.args[1].value
            else:
                continue
            if attr not in names or attr in own.get(node, ()):
                continue
            if isinstance(subject, ast.Name) and subject.id in ("self", "cls"):
                continue
            found.add((str(path.relative_to(root)), node.lineno, ast.unparse(subject), attr))
    return [f"{path}:{line}: {subject}.{attr} reaches the Engine's private {attr!r} from outside "
            f"megacompile/engine/" for path, line, subject, attr in sorted(found)]


# --- the map in docs/architecture.md ------------------------------------------------------------

_MAP_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|")


def room_of_path(text: str) -> str:
    """`megacompile/engine/` -> engine, `kernels/` -> kernels, `megacompile/__init__.py` -> __init__."""
    name = text.strip().rstrip("/")
    if name.startswith(SOURCE_ROOTS[PACKAGE] + "/"):
        name = name[len(SOURCE_ROOTS[PACKAGE]) + 1:]
    return name.removesuffix(".py")


def doc_layers(text: str) -> list[set[str]]:
    """The layered map: rows `| <layer> | `<room path>` | ...` of the first table of the doc that
    has them, bottom layer first."""
    layers: dict[int, set[str]] = {}
    for line in text.splitlines():
        match = _MAP_ROW.match(line)
        if match:
            layers.setdefault(int(match[1]), set()).add(room_of_path(match[2]))
        elif layers and not line.startswith("|"):
            break
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"the layered map numbers its layers {sorted(layers)}; expected 0, 1, 2, ...")
    return [layers[i] for i in range(len(layers))]


def check(root: Path, layers) -> list[str]:
    """Every rule, one message per violation; empty when the tree keeps them all."""
    graph = build_graph(root)
    return (unplaced_rooms(root, graph, layers) + import_cycles(graph, layers)
            + layer_violations(graph, layers) + engine_private_access(root))
