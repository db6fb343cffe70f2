"""The train room's own rules (tests/train_rules.py): other rooms through their public names, and
finetuning_type read where run.yaml is checked and where what trains is decided. The planted tests
break a copy of the source and check that the rule names the break."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import train_rules

ROOT = Path(__file__).resolve().parents[2]


def test_train_reaches_other_rooms_through_their_packages():
    assert train_rules.private_imports(ROOT) == []


def test_finetuning_type_is_read_in_config_and_methods_alone():
    assert train_rules.finetuning_type_reads(ROOT) == []


@pytest.fixture
def tree(tmp_path):
    shutil.copytree(ROOT / "megacompile" / "train", tmp_path / "megacompile" / "train",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: Path, text: str) -> int:
    old = path.read_text()
    path.write_text(old + ("" if old.endswith("\n") else "\n") + text)
    return old.count("\n") + 1 + (not old.endswith("\n"))


def test_a_planted_import_of_a_module_inside_another_room_is_named(tree):
    line = _append(tree / "megacompile" / "train" / "stages" / "sft.py",
                   "def _planted():\n    from ...planner.search import make_plan\n    return make_plan\n") + 1
    assert train_rules.private_imports(tree) == [
        f"megacompile/train/stages/sft.py:{line}: train imports megacompile.planner.search, a module inside the room "
        "planner; import what it exports from megacompile.planner (add the name to its __init__ if it is the room's "
        "to give)"]


def test_the_room_packages_and_io_modules_are_not_named(tree):
    _append(tree / "megacompile" / "train" / "stages" / "sft.py",
            "def _planted():\n    from ...planner import Plan\n    from ...io.checkpoint import committed_beside\n"
            "    import megacompile\n    from .. import methods\n    return Plan, committed_beside, methods\n")
    assert train_rules.private_imports(tree) == []


def test_a_planted_read_of_finetuning_type_is_named(tree):
    line = _append(tree / "megacompile" / "train" / "trained_model.py",
                   "def _planted(c):\n    return c.finetuning_type == 'lora'\n") + 1
    assert train_rules.finetuning_type_reads(tree) == [
        f"megacompile/train/trained_model.py:{line}: reads finetuning_type; ask methods (methods.adapters(c), "
        "methods.apply) what the run trains"]
