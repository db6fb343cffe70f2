"""The import arrows of megacompile point one way: down the layer list below, which is the
layered map at the top of docs/architecture.md (a test keeps the two the same).

The tests on the real tree say what is wrong with it; the planted tests copy the source to a
temporary folder, break one rule there, and check that the checker names the break.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import layering

ROOT = Path(__file__).resolve().parents[2]

# Bottom first; each entry a set of rooms (see tests/layering.py's room_of). A room may import
# any room of a layer below it and, without a cycle between rooms, one of its own layer.
LAYERS = [
    {"errors", "arguments", "settings", "native"},
    {"kernels", "models", "optim"},
    {"ir", "moe", "attention", "linear_attention"},
    {"capture", "report"},
    {"passes", "fusion"},
    {"cost"},
    {"planner"},
    {"disk", "runtime"},
    {"state"},
    {"io", "distributed"},
    {"engine"},
    {"calibrate"},
    {"__init__"},
    {"acceptance"},
    {"bench", "posttrain", "train"},
    {"cli", "__main__"},
]


def _report(messages):
    return "\n" + "\n".join(messages)


# --- the real tree -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph():
    return layering.build_graph(ROOT)


def test_the_map_in_the_architecture_doc_is_the_layer_list():
    assert layering.doc_layers((ROOT / "docs" / "architecture.md").read_text()) == LAYERS


def test_every_room_is_placed_in_a_layer(graph):
    messages = layering.unplaced_rooms(ROOT, graph, LAYERS)
    assert not messages, _report(messages)


def test_no_import_cycle(graph):
    messages = layering.import_cycles(graph, LAYERS)
    assert not messages, _report(messages)


def test_no_import_up_the_layers(graph):
    messages = layering.layer_violations(graph, LAYERS)
    assert not messages, _report(messages)


def test_no_reach_into_the_engines_private_attributes():
    messages = layering.engine_private_access(ROOT)
    assert not messages, _report(messages)


def test_no_store_into_the_training_state_outside_its_room():
    messages = layering.training_state_stores(ROOT)
    assert not messages, _report(messages)


def test_the_training_state_goes_by_the_names_the_store_rule_reads():
    # Every parameter and local the rule takes for a TrainingState is named as the convention
    # says, and the rooms that work on the state are among them: the rule sees what it guards.
    holders = layering.state_holders(ROOT)
    assert {name for _, _, name in holders} <= set(layering.STATE_NAMES), holders
    rooms = {path.split("/")[1] for path, _, _ in holders}
    assert {"engine", "io", "distributed"} <= rooms, rooms


# --- planted breaks ----------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    """A copy of the package's source, to break."""
    for folder in layering.SOURCE_ROOTS.values():
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.txt", "*.cpp", "*.yaml"))
    return tmp_path


def _append(path: Path, text: str) -> int:
    """Append text to a file; the line number its first line lands on."""
    old = path.read_text() if path.exists() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    path.write_text(old + text)
    return old.count("\n") + 1


def test_a_planted_import_from_ir_up_to_the_engine_is_a_cycle_and_an_up_arrow(tree):
    program = "megacompile.ir.program"
    before = layering.import_cycles(layering.build_graph(tree), LAYERS)
    assert not any(program in m for m in before)
    line = _append(tree / "megacompile" / "ir" / "program.py",
                   "def _planted():\n    from ..engine import Engine\n    return Engine\n") + 1

    graph = layering.build_graph(tree)
    cycles = layering.import_cycles(graph, LAYERS)
    named = [m for m in cycles if f"{program} -> megacompile.engine -> " in m]
    assert named, _report(cycles)
    path = next(p for p in named[0].splitlines() if p.strip().startswith(f"{program} -> megacompile.engine"))
    steps = path.split("(")[0].split(" -> ")
    assert steps[-1].strip() == program
    assert all(graph.has_edge(a.strip(), b.strip()) for a, b in zip(steps, steps[1:]))

    violations = layering.layer_violations(graph, LAYERS)
    assert (f"megacompile/ir/program.py:{line}: {program} (room ir, layer 2) imports megacompile.engine "
            f"(room engine, layer 10): an import up the layer list") in violations, _report(violations)


def test_a_type_checking_import_counts(tree):
    line = _append(tree / "megacompile" / "errors.py",
                   "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .ir.program import Program\n") + 2
    violations = layering.layer_violations(layering.build_graph(tree), LAYERS)
    assert any(m.startswith(f"megacompile/errors.py:{line}: megacompile.errors (room errors, layer 0) "
                            f"imports megacompile.ir.program") for m in violations), _report(violations)


def test_rooms_of_one_layer_that_import_each_other_are_a_cycle(tree):
    # Two peers of one layer, each importing the other from a module of its own: no module cycle.
    _append(tree / "megacompile" / "io" / "planted.py", "def _planted():\n    from .. import distributed\n")
    _append(tree / "megacompile" / "distributed" / "planted.py", "def _planted():\n    from .. import io\n")
    messages = layering.layer_violations(layering.build_graph(tree), LAYERS)
    assert any(m.startswith("rooms of layer 9 import each other in a cycle distributed -> io -> distributed")
               for m in messages), _report(messages)


def test_a_planted_reach_into_the_engines_private_state_is_named(tree):
    name = sorted(layering.engine_private_names(tree))[0]
    line = _append(tree / "megacompile" / "io" / "planted.py", f"def _planted(engine):\n    return engine.{name}\n") + 1
    messages = layering.engine_private_access(tree)
    assert (f"megacompile/io/planted.py:{line}: engine.{name} reaches the Engine's private {name!r} "
            f"from outside megacompile/engine/") in messages, _report(messages)


def test_another_class_using_its_own_private_attribute_is_not_named(tree):
    name = sorted(layering.engine_private_names(tree))[0]
    before = layering.engine_private_access(tree)
    _append(tree / "megacompile" / "io" / "planted.py",
            f"class Other:\n    def __init__(self):\n        self.{name} = 1\n\n"
            f"    def same(self, other):\n        return self.{name} + other.{name}\n")
    assert layering.engine_private_access(tree) == before


def test_planted_stores_into_the_training_state_are_named(tree):
    line = _append(tree / "megacompile" / "io" / "planted.py",
                   "def _planted(state: \"TrainingState\", engine, other):\n"
                   "    state.steps_done = 3\n"
                   "    engine.state.counters.loads += 1\n"
                   "    setattr(state, 'run_id', 'x')\n"
                   "    del state.pending_load\n"
                   "    held, backend = engine.state, engine.backend\n"
                   "    held.missed_steps['w'] = 1\n") + 1
    messages = layering.training_state_stores(tree)
    stores = {line: "state.steps_done", line + 1: "engine.state.counters.loads",
              line + 2: "setattr(state, 'run_id', 'x')", line + 3: "del state.pending_load",
              line + 5: "held.missed_steps['w']"}
    assert messages == [f"megacompile/io/planted.py:{at}: {store} stores into the TrainingState outside "
                        "megacompile/state/: change it through a transition of state/training.py"
                        for at, store in stores.items()], _report(messages)


def test_other_objects_named_like_the_training_state_are_not_named(tree):
    # A dict or tensor named `state`, another object's `.state`, capture/chunk.py's `_state`.
    _append(tree / "megacompile" / "io" / "planted.py",
            "import threading\n_state = threading.local()\n\n\n"
            "def _planted(state: dict, captured, training_state):\n"
            "    state['w'] = 1\n    captured.state.x = 1\n    _state.inside = True\n\n"
            "    def inner(state):\n        return state\n    return inner\n\n\n"
            "def _rebound(engine):\n    state = {}\n    state['w'] = 1\n")
    (tree / "megacompile" / "state" / "planted.py").write_text("def _planted(state):\n    state.steps_done = 1\n")
    assert layering.training_state_stores(tree) == []


def test_a_planted_room_not_in_the_layer_list_is_named(tree):
    (tree / "megacompile" / "newroom").mkdir()
    (tree / "megacompile" / "newroom" / "__init__.py").write_text("")
    (tree / "megacompile" / "loose.py").write_text("from .errors import MegacompileError\n")
    messages = layering.unplaced_rooms(tree, layering.build_graph(tree), LAYERS)
    assert any(m.startswith("folder megacompile/newroom/ is room 'newroom'") for m in messages), _report(messages)
    assert any(m.startswith("module megacompile.loose is room 'loose'") for m in messages), _report(messages)


def test_imports_resolve_relative_names_submodules_and_the_top_level_folders(tree):
    _append(tree / "megacompile" / "ir" / "planted.py",
            "from . import program\nfrom .. import errors\nimport megacompile.passes.lower\n"
            "from megacompile.kernels import check\nfrom ..ir import NotAModule\n")
    graph = layering.build_graph(tree)
    assert set(graph.successors("megacompile.ir.planted")) == {
        "megacompile.ir.program", "megacompile.errors", "megacompile.passes.lower",
        "megacompile.kernels.check", "megacompile.ir"}


def test_the_map_parser_reads_layers_bottom_first():
    text = ("# A\n\n| layer | room | holds |\n| --- | --- | --- |\n| 0 | `megacompile/errors.py` | x |\n"
            "| 1 | `kernels/` | y |\n| 1 | `megacompile/engine/` | z |\n| 2 | `megacompile/__init__.py` | w |\n\nmore\n"
            "| 7 | `megacompile/later/` | not the map |\n")
    assert layering.doc_layers(text) == [{"errors"}, {"kernels", "engine"}, {"__init__"}]


# --- a Plan is frozen once solved ----------------------------------------------------------------

def test_no_store_on_a_solved_plan_outside_the_planner():
    messages = layering.plan_stores(ROOT)
    assert not messages, _report(messages)


def test_the_plan_attributes_read_from_the_source_are_the_plans():
    import dataclasses

    from megacompile.planner import Plan
    attributes = layering.plan_attributes(ROOT)
    assert {f.name for f in dataclasses.fields(Plan)} <= attributes
    assert {name for name, v in vars(Plan).items() if isinstance(v, property)} <= attributes
    assert {"_spans", "curve"} <= attributes       # the caches its methods keep


def test_planted_stores_on_a_plan_are_named_with_file_and_line(tree):
    line = _append(tree / "megacompile" / "io" / "planted.py",
                   "def _planted(engine, compiled, given: Plan, other):\n"
                   "    engine.plan.budget_bytes = 1\n"
                   "    compiled.plan.measured_peak_bytes += 1\n"
                   "    given.vision = None\n"
                   "    setattr(engine.plan, 'timeline', None)\n"
                   "    object.__setattr__(given, 'curve', None)\n"
                   "    held = engine.plan\n"
                   "    del held.host_cost\n"
                   "    other.budget_bytes = 1\n"
                   "    engine.plan.measured.peak_bytes = 1\n")
    messages = layering.plan_stores(tree)
    named = {m.split(" stores on a Plan")[0] for m in messages}
    where = "megacompile/io/planted.py"
    assert named == {f"{where}:{line + 1}: engine.plan.budget_bytes",
                     f"{where}:{line + 2}: compiled.plan.measured_peak_bytes",
                     f"{where}:{line + 3}: given.vision",
                     f"{where}:{line + 4}: setattr(engine.plan, 'timeline', None)",
                     f"{where}:{line + 5}: object.__setattr__(given, 'curve', None)",
                     f"{where}:{line + 7}: del held.host_cost"}, _report(messages)


def test_a_store_on_a_plan_inside_the_planner_is_not_named(tree):
    _append(tree / "megacompile" / "planner" / "planted.py", "def _planted(plan):\n    plan.budget_bytes = 1\n")
    assert layering.plan_stores(tree) == []
