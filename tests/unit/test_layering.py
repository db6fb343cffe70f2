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
    {"errors", "arguments", "settings"},
    {"kernels", "models", "optim"},
    {"ir", "moe"},
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
