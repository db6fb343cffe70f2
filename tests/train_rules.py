"""The rules of the train room that the import graph cannot see (tests/unit/test_train_rules.py):

  public API   train/ reaches another room only through the room's package, the names its
               __init__ exports (`from ..posttrain import DPOLoss`), never a module inside it
               (`from ..posttrain.dpo import DPOLoss`); io/ is the exception, its modules being the
               file formats a run reads and writes
  one reader   `finetuning_type` is read (an attribute load `x.finetuning_type`) in config.py, which
               checks run.yaml, and methods/, which decides what trains; every other file asks
               methods (`methods.adapters(c)`)
Read from the source with `ast`; nothing is imported.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.layering import PACKAGE, parse

TRAIN = Path("megacompile") / "train"
OPEN_ROOMS = ("train", "io")            # rooms whose modules train may import one by one
FINETUNING_READERS = (TRAIN / "config.py", TRAIN / "methods" / "__init__.py")


def _train_files(root: Path):
    for path in sorted((root / TRAIN).rglob("*.py")):
        yield path, path.relative_to(root)


def _module_of(rel: Path) -> tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _from_target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(root: Path) -> list[str]:
    """'file:line: ...' for every import in train/ of a module inside another room."""
    found = []
    for path, rel in _train_files(root):
        module, is_package = _module_of(rel)
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.ImportFrom):
                targets = [_from_target(module, is_package, node)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] == PACKAGE and len(parts) > 2 and parts[1] not in OPEN_ROOMS:
                    found.append(f"{rel}:{node.lineno}: train imports {target}, a module inside the room "
                                 f"{parts[1]}; import what it exports from {PACKAGE}.{parts[1]} (add the name to its "
                                 "__init__ if it is the room's to give)")
    return found


def finetuning_type_reads(root: Path) -> list[str]:
    """'file:line: ...' for every read of `.finetuning_type` outside config.py and methods/."""
    found = []
    for path, rel in _train_files(root):
        if rel in FINETUNING_READERS:
            continue
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Attribute) and node.attr == "finetuning_type" and isinstance(node.ctx, ast.Load):
                found.append(f"{rel}:{node.lineno}: reads finetuning_type; ask methods (methods.adapters(c), "
                             "methods.apply) what the run trains")
    return found
