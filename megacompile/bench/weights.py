"""The bench model's fp32 weights in a folder, written once per shape and seed, in a process of its
own:

    python -m megacompile.bench.weights WORKLOAD.json FOLDER     # prints the weights' folder

megacompile builds the model on the meta device and streams these into its masters at the first
step (engine/from_pretrained.py's compile_folder): the process never holds the module's fp32
weights beside the masters (25 GiB at the Llama-2-7B shape). DeepSpeed sets its fp32 masters from
them. Safetensors, one shard per block and one for the rest, under an index written last: a folder
with its index is complete, and one without it is written again. The folder must be on a disk
with room for them: on a file system in RAM (tmpfs) they would sit beside the run's host state,
and 25 GiB more at 7B is what a 128 GiB machine does not have.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ArgumentError
from ..io.hf_layout import INDEX
from .workload import Workload

# File systems whose files are held in RAM.
IN_RAM = ("tmpfs", "ramfs")
GiB = 2 ** 30


def file_system(path: Path, mounts: str = "/proc/mounts") -> str:
    """The type of the file system holding `path` (its nearest mount point), or "unknown"."""
    where = os.path.realpath(path)
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return "unknown"
    nearest, kind = "", "unknown"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(nearest):
            nearest, kind = point, fields[2]
    return kind


def check_room(workload: Workload, root: Path, mounts: str = "/proc/mounts") -> None:
    """Refuses a `root` in RAM or without room for the workload's fp32 weights, before any is built."""
    need = 4 * workload.parameters
    kind = file_system(root, mounts)
    if kind in IN_RAM:
        raise ArgumentError(f"the weights folder {root} is on {kind}, a file system in RAM: its "
                            f"{need / GiB:.1f} GiB would sit beside the run's host state; give --weights "
                            "(lease.sh: WEIGHTS) a folder on a disk")
    existing = Path(os.path.realpath(root))
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ArgumentError(f"the weights folder {root} has {free / GiB:.1f} GiB free, the model's fp32 "
                            f"weights need {need / GiB:.1f} GiB; give --weights (lease.sh: WEIGHTS) a folder "
                            "on a disk with room, or remove other weights there")


def write(workload: Workload, root: Path) -> Path:
    """root/<workload.weights_name>, written from workload.model() unless it is there complete."""
    target = Path(root) / workload.weights_name
    if (target / INDEX).is_file():
        return target
    # What a call cut short left (a partial folder, a target without its index) goes before the
    # room is counted: on a resumed lease it is most of the room the weights need.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(target, ignore_errors=True)
    check_room(workload, root)
    partial.mkdir(parents=True)
    state = workload.model().state_dict()
    shards: dict[str, list[str]] = {}
    for name in state:
        parts = name.split(".")
        file = f"block-{int(parts[1]):03d}.safetensors" if parts[0] == "blocks" else "rest.safetensors"
        shards.setdefault(file, []).append(name)
    for file, names in shards.items():          # one shard in flight: its bytes, not the model's twice
        save_file({n: state[n].detach().contiguous() for n in names}, str(partial / file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values()),
                          "workload": workload.to_dict()},
             "weight_map": {n: file for file, names in shards.items() for n in names}}
    (partial / INDEX).write_text(json.dumps(index, indent=1))
    os.replace(partial, target)
    return target


def read(folder: Path, names: list[str]):
    """(name, fp32 tensor) for each name, one at a time, from the folder write() made."""
    weight_map = json.loads((Path(folder) / INDEX).read_text())["weight_map"]
    for name in names:
        with safe_open(str(Path(folder) / weight_map[name]), framework="pt") as f:
            yield name, f.get_tensor(name).to(torch.float32)


if __name__ == "__main__":
    spec, root = sys.argv[1:3]
    print(write(Workload(**json.loads(Path(spec).read_text())), Path(root)))
