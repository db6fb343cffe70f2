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


# --- stores into the TrainingState --------------------------------------------------------------
#
# megacompile/state/ owns the TrainingState: elsewhere its fields are read, and changed only
# through its transitions. Which expressions hold one is read from the package's naming, which
# state_holders() lists for the tests to keep:
#   - the Engine holds it as `.state`: `engine.state`, `self.engine.state` / `self._engine.state`,
#     and `self.state` in the engine's room (megacompile/engine/);
#   - a function takes it as a parameter annotated `TrainingState` (io/, distributed/: all named
#     `state`), or unannotated and named `state` or `training_state`;
#   - a local bound to one of those (`state = engine.state`).
# A name `state` annotated or bound otherwise (a dict of tensors, a torch RNG state) is not one;
# nor is `_state` (capture/chunk.py's thread-local). A TrainingState reached another way (through
# a weak reference, getattr) is not seen.

STATE_NAMES = ("state", "training_state")
_ENGINE_NAMES = ("engine", "_engine")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _names_state(annotation: ast.AST | None) -> bool:
    return annotation is not None and "TrainingState" in ast.unparse(annotation)


def _is_state(node: ast.AST, names: set[str], engine_room: bool) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute) and node.attr == "state":
        holder = node.value
        return (isinstance(holder, ast.Name) and (holder.id in _ENGINE_NAMES or holder.id == "self" and engine_room)
                or isinstance(holder, ast.Attribute) and holder.attr in _ENGINE_NAMES)
    return False


def _own_nodes(scope: ast.AST):
    """The nodes of a scope, not descending into the functions and classes it defines."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (*_SCOPES, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))


def _bound(target: ast.AST, value: ast.AST | None) -> list[tuple[str, ast.AST | None, None]]:
    """(name, the value it takes, if known) for each name an assignment binds: `a, b = x, y` too."""
    if isinstance(target, ast.Name):
        return [(target.id, value, None)]
    if isinstance(target, (ast.Tuple, ast.List)):
        values = (value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                  else [None] * len(target.elts))
        return [pair for t, v in zip(target.elts, values) for pair in _bound(t, v)]
    if isinstance(target, ast.Starred):
        return _bound(target.value, None)
    return []


def _scope_names(scope: ast.AST, outer: set[str], engine_room: bool) -> set[str]:
    """The names that hold a TrainingState in `scope` (a module or a function): its parameters
    and bindings as the convention above reads them, and the enclosing scope's it does not rebind."""
    names = set(outer)
    if isinstance(scope, _SCOPES):
        args = scope.args
        for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
            if a is None:
                continue
            names.discard(a.arg)
            if _names_state(a.annotation) or a.annotation is None and a.arg in STATE_NAMES:
                names.add(a.arg)
    bindings = []
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign):
            bindings += [pair for t in node.targets for pair in _bound(t, node.value)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bindings.append((node.target.id, node.value, node.annotation))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension, ast.withitem)):
            target = node.optional_vars if isinstance(node, ast.withitem) else node.target
            bindings += [(t.id, None, None) for t in ast.walk(target) if isinstance(t, ast.Name)] if target else []
    for _ in range(len(bindings) + 1):    # `a = engine.state; b = a` takes two rounds
        held = {name for name, value, annotation in bindings
                if _names_state(annotation) or value is not None and _is_state(value, names, engine_room)}
        if held <= names:
            break
        names |= held
    rebound = {name for name, _, _ in bindings} - {name for name, value, annotation in bindings
                                                   if _names_state(annotation)
                                                   or value is not None and _is_state(value, names, engine_room)}
    return names - rebound


def _holds_state(node: ast.AST, names: set[str], engine_room: bool) -> bool:
    """Whether `node` is a TrainingState or reached through one (state.counters, state.x[0])."""
    while True:
        if _is_state(node, names, engine_room):
            return True
        if not isinstance(node, (ast.Attribute, ast.Subscript)):
            return False
        node = node.value


def _stores(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(object stored into, what the store reads as) for each attribute or item store of `node`."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        targets = [node.optional_vars]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
          and node.args):
        return [(node.args[0], ast.unparse(node))]
    else:
        return []
    verb = "del " if isinstance(node, ast.Delete) else ""
    return [(t.value, verb + ast.unparse(t)) for target in targets for t in ast.walk(target)
            if isinstance(t, (ast.Attribute, ast.Subscript)) and isinstance(t.ctx, (ast.Store, ast.Del))]


def _scopes(tree: ast.Module, engine_room: bool):
    """(scope, names holding a TrainingState there) for the module and each function and class
    body in it; a class body has its enclosing scope's names, and passes them to its methods."""
    todo = [(tree, set(), True)]
    while todo:
        scope, outer, own = todo.pop()
        names = _scope_names(scope, outer, engine_room) if own else outer
        yield scope, names
        for node in _own_nodes(scope):
            if isinstance(node, (*_SCOPES, ast.ClassDef)):
                todo.append((node, names, not isinstance(node, ast.ClassDef)))


def _state_stores_in(tree: ast.Module, engine_room: bool):
    """(line, store) of each store into a TrainingState in the module."""
    for scope, names in _scopes(tree, engine_room):
        for node in _own_nodes(scope):
            for obj, text in _stores(node):
                if _holds_state(obj, names, engine_room):
                    yield node.lineno, text


def _outside_state_room(root: Path):
    state_room = root / SOURCE_ROOTS[PACKAGE] / "state"
    engine_room = root / SOURCE_ROOTS[PACKAGE] / "engine"
    for path in find_modules(root).values():
        if state_room not in path.parents:
            yield path, engine_room in path.parents


def training_state_stores(root: Path) -> list[str]:
    """Attribute and item stores (=, +=, annotated =, del, setattr, delattr) into a TrainingState,
    or into what it holds, outside megacompile/state/."""
    root = Path(root)
    found = set()
    for path, engine_room in _outside_state_room(root):
        for line, text in _state_stores_in(parse(path), engine_room):
            found.add((str(path.relative_to(root)), line, text))
    return [f"{path}:{line}: {text} stores into the TrainingState outside megacompile/state/: change it "
            f"through a transition of state/training.py" for path, line, text in sorted(found)]


def state_holders(root: Path) -> list[tuple[str, int, str]]:
    """(file, line, name) of each parameter and local the convention above takes for a
    TrainingState, outside megacompile/state/: what the tests check the convention against."""
    root = Path(root)
    found = set()
    for path, engine_room in _outside_state_room(root):
        where = str(path.relative_to(root))
        for scope, names in _scopes(parse(path), engine_room):
            if isinstance(scope, _SCOPES):
                args = scope.args
                found.update((where, a.lineno, a.arg) for a in args.posonlyargs + args.args + args.kwonlyargs
                             if a.arg in names)
            for node in _own_nodes(scope):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id in names:
                    found.add((where, node.lineno, node.id))
    return sorted(found)


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


# --- stores on a solved Plan --------------------------------------------------------------------
#
# A Plan is frozen once solved (megacompile/planner/result.py): outside megacompile/planner/ no
# code sets, deletes or setattr()s its attributes; planning revises a copy (Plan.revised) and a
# run keeps what it measures beside the plan (planner/measured.py). Which expressions hold a Plan
# is read from the package's naming: the names `plan`, `result` and `chosen`, a name annotated
# `Plan` (a parameter, an annotated assignment), an attribute `.plan` (`engine.plan`,
# `compiled.plan`), and a name bound to one of those in the same file. Which attributes are the
# Plan's is read from result.py: the names class Plan defines (fields, properties, methods) and
# the caches its methods keep with object.__setattr__(self, ...).

PLAN_NAMES = ("plan", "result", "chosen")
PLAN_SOURCE = "planner/result.py"


def _sets_an_attribute(node: ast.AST) -> bool:
    """setattr(...), delattr(...), object.__setattr__(...), object.__delattr__(...)."""
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id in ("setattr", "delattr")
            or isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__"))


def plan_attributes(root: Path) -> set[str]:
    """The attribute names of class Plan, from the source of megacompile/planner/result.py."""
    path = Path(root) / SOURCE_ROOTS[PACKAGE] / PLAN_SOURCE
    plan = next(n for n in ast.walk(parse(path)) if isinstance(n, ast.ClassDef) and n.name == "Plan")
    names = set()
    for node in plan.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("__"):
            names.add(node.name)
    for node in ast.walk(plan):
        if (_sets_an_attribute(node) and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
                and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


def _annotated_plan(annotation: ast.AST | None) -> bool:
    return annotation is not None and re.search(r"\bPlan\b", ast.unparse(annotation)) is not None


def _holds_plan(node: ast.AST, names: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names
            or isinstance(node, ast.Attribute) and node.attr == "plan")


def _plan_names(tree: ast.Module) -> set[str]:
    """The names of a file that hold a Plan, by the convention above."""
    names = set(PLAN_NAMES)
    bound = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _annotated_plan(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _annotated_plan(node.annotation):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            bound += [(t.id, node.value) for t in node.targets if isinstance(t, ast.Name)]
    while True:     # `p = engine.plan; q = p`
        more = {name for name, value in bound if _holds_plan(value, names)} - names
        if not more:
            return names
        names |= more


def _plan_stores_in(tree: ast.Module, attributes: set[str]):
    """(line, store) of each store on a Plan in the module: an attribute the Plan has, or any name
    setattr() is given that is not a literal."""
    names = _plan_names(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del))
                and node.attr in attributes and _holds_plan(node.value, names)):
            yield node.lineno, ("del " if isinstance(node.ctx, ast.Del) else "") + ast.unparse(node)
        elif _sets_an_attribute(node) and _holds_plan(node.args[0], names):
            name = node.args[1]
            if not isinstance(name, ast.Constant) or name.value in attributes:
                yield node.lineno, ast.unparse(node)


def plan_stores(root: Path) -> list[str]:
    """Stores (=, +=, annotated =, del, setattr, delattr, object.__setattr__) on a Plan's
    attributes outside megacompile/planner/."""
    root = Path(root)
    planner = root / SOURCE_ROOTS[PACKAGE] / "planner"
    attributes = plan_attributes(root)
    found = set()
    for path in find_modules(root).values():
        if planner in path.parents:
            continue
        for line, text in _plan_stores_in(parse(path), attributes):
            found.add((str(path.relative_to(root)), line, text))
    return [f"{path}:{line}: {text} stores on a Plan outside megacompile/planner/: a plan is frozen once solved; "
            f"planning revises a copy (Plan.revised), a run keeps what it measures beside it "
            f"(planner/measured.py)" for path, line, text in sorted(found)]
