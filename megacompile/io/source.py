"""Streaming tensors from safetensors files into the host state, one tensor at a time.

A load checks names, shapes and files first (the callers do), then streams: each tensor is read
into a buffer of its own size (safetensors' pread backend: a memory map would keep every page
it touched resident until the file closes, a whole shard), cast as it is copied into the fp32
master and the compute copy, and dropped. Peak host memory is the host state plus the largest
tensor.

An engine that has no host state yet (nothing traced: the layout of the flat buffers comes from
the trace) keeps the load as pending and the engine runs it when it builds the host state.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from safetensors import safe_open

from ..errors import WeightsFileError
from . import pages

# What a stored tensor becomes: a model weight (master and compute copy, or a buffer), or one of
# a checkpoint's optimizer tables for a trainable parameter.
WEIGHT, MASTER, TABLES, CONST = "weight", "master", ("exp_avg", "exp_avg_sq", "grad"), "const"


@dataclass
class Item:
    path: str
    key: str       # the tensor's name in the file
    table: str     # WEIGHT, MASTER, CONST or one of TABLES
    name: str      # the canonical parameter or buffer name
    part: tuple | None = None   # a slice of it (hf_layout.Part: one expert's share of a fused weight)


@dataclass
class PendingLoad:
    items: list[Item]
    # Buffers the model computed itself (non-persistent, e.g. rotary inv_freq rebuilt from the config).
    own_buffers: bool = False
    # Parameters the module itself holds (a PEFT model's adapters, made beside a base that streams
    # from the files): loaded from the module, not the files.
    own_params: tuple[str, ...] = ()
    needs: tuple[str, ...] = (MASTER,)   # the tables every trainable parameter must have
    describe: str = "the weights"
    # Saved between a step's micro-batches: the parameters whose gradient sums they made (None: saved
    # at a step boundary).
    reached: frozenset | None = None
    # Tensors already in memory, by the `path` their items give in place of a file, then by key
    # (io/trainer_checkpoint.py: the moments of a torch optimizer's state_dict).
    memory: dict | None = None
    # The keys of `memory` whose tensors view a memory-mapped file: each one's pages are given back
    # once it is written (io/pages.py), so the file is never held whole beside the host state.
    mapped: frozenset[str] = frozenset()

    def missing(self, host) -> list[str]:
        have = defaultdict(set)
        have[MASTER].update(self.own_params)
        for it in self.items:
            have[MASTER if it.table == WEIGHT else it.table].add(it.name)
        return [f"{table}/{name}" if table != MASTER else name for table in self.needs
                for name in host.slots if name not in have[table]]

    def apply(self, host, model: nn.Module | None = None) -> None:
        missing = self.missing(host)
        if missing:
            raise WeightsFileError(f"{self.describe} lack {len(missing)} tensors the model needs "
                                   f"({', '.join(missing[:4])}); nothing was loaded")
        with torch.no_grad():
            if self.own_buffers and model is not None:
                host.load({n: b for n, b in model.named_buffers() if n in host.consts and not b.is_meta})
            if self.own_params and model is not None:
                host.load({n: p for n, p in model.named_parameters() if n in self.own_params})
            by_file: dict[str, list[Item]] = defaultdict(list)
            for it in self.items:
                by_file[it.path].append(it)
            for path, items in by_file.items():
                if self.memory is not None and path in self.memory:
                    for it in items:
                        t = self.memory[path][it.key]
                        _write(host, it, t)
                        if it.key in self.mapped:
                            pages.drop(t)
                        del t       # before the next is gathered: one such tensor alive at a time
                    continue
                try:
                    with safe_open(path, framework="pt", backend="pread") as f:
                        for it in items:
                            _write(host, it, f.get_tensor(it.key))
                except WeightsFileError:
                    raise
                except Exception as e:  # noqa: BLE001 - an unreadable shard: name it
                    raise WeightsFileError(f"cannot read {path}: {e}") from e
        if self.reached is not None:
            host.resume_mid_step(set(self.reached))


def _write(host, it: Item, t: torch.Tensor) -> None:
    if it.part is not None:
        _write_part(host, it, t)
    elif it.table in (WEIGHT, MASTER, CONST):
        if it.name not in host.slots and it.name not in host.consts:
            raise WeightsFileError(f"{it.path}: {it.key} is no parameter or buffer of the traced model")
        problems = host.load_problems({it.name: t})
        if problems:
            raise WeightsFileError(f"{it.path}: {it.key}: {problems[0]}; nothing was loaded")
        host.load({it.name: t})
    else:
        dst = host.view(it.table, it.name)
        if tuple(t.shape) != tuple(dst.shape):
            raise WeightsFileError(f"{it.path}: {it.key} has shape {tuple(t.shape)}, the model {tuple(dst.shape)}")
        dst.copy_(t)


def _write_part(host, it: Item, t: torch.Tensor) -> None:
    """One stored expert tensor into its slice of a fused master (and compute copy)."""
    from .hf_layout import part_of
    if not t.is_floating_point() or not bool(torch.isfinite(t).all()):
        raise WeightsFileError(f"{it.path}: {it.key} holds inf or NaN, or is not floating point; nothing was loaded")
    if it.name in host.consts:      # a frozen expert weight
        host.fill_const(it.name, part_of(host.consts[it.name], it.part), t)
        return
    part_of(host.view("master", it.name), it.part).copy_(t)
    buffers = host.owners[host.slots[it.name].owner]
    if buffers.compute is not buffers.master:
        part_of(host.source(it.name), it.part).copy_(t)


def made_as_read(items: list, keys, mark: str, make: Callable) -> tuple[list, dict]:
    """The load's `items` with those whose key is in `keys` read through PendingLoad.memory rather
    than from their file: `make(f, key)`, `f` the file opened (safetensors, pread), gives each such
    tensor as a run makes it from the file's own (io/grown_vocab.py, train/methods/pissa.py), when the
    load asks for it, one at a time. `mark` tells their sources from the files'. (items, memory)."""
    memory, out = {}, []
    for it in items:
        if it.key in keys:
            path = mark + it.path
            memory.setdefault(path, _MadeAsRead(it.path, frozenset(keys), make))
            it = replace(it, path=path)
        out.append(it)
    return out, memory


class _MadeAsRead(Mapping):
    """key -> make(f, key) for the file `file` (made_as_read)."""

    def __init__(self, file: str, keys: frozenset[str], make: Callable):
        self.file, self.keys, self.make = file, keys, make

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(self.file, framework="pt", backend="pread") as f:
            return self.make(f, key)

    def __iter__(self):
        return iter(sorted(self.keys))

    def __len__(self) -> int:
        return len(self.keys)
