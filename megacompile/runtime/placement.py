"""Where one schedule node's device tensors go in the arena (runtime/arena.py).

A node's planned tensors (ir/arena.py ArenaTensor, found by the node's index) are of two kinds:
  - a schedule value's storage the node writes itself (streamed weights, a model input, the
    loss seed, a restored stash), found by its storage key: `values`;
  - a storage an op of the node's stage graph makes, found by the op's name and which of its
    results it is: `places`, one entry per op of the graph, each a callable the graph runs in the
    op's stead (ir/stage_program.py `run(..., places)`).

An op with an out= form (ir/stage_ops.py `out_form`: most ATen ops) writes its results straight
into their arena tensors; so does a fused kernel, which takes its results from them
(kernels/outputs.py); a factory (zeros, full, the empties, arange) or a cast (`_to_copy`) does not
run, its result is made in its arena tensor (`in_place_form`). An op with none of these (attention),
or whose out= form only runs it and copies (`allocates_inside`: the embedding's backward),
runs as it is and its results are copied into their arena tensors at once:
its own result is then scratch, freed before the next op, like the workspace it allocates inside
itself; `copied` counts the ops that copied.
An op whose results cannot be placed (a size known only at run time, results sharing a storage)
runs as it is and its results stay where torch put them: the ledger sees them outside the arena
and `engine.memory_stats()` counts them (`device_allocations_last_step`).

Placements are made once per node and arena generation and reused every step: the tensors are
the same bytes each step, so nothing is allocated after the first.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..ir.arena import ArenaTensor
from ..ir.stage_ops import in_place_form, writes_into
from ..ir.stage_program import StageProgram, fake_storage_key, tensors_of
from ..kernels import outputs
from .arena import Arena, typed


class Copied:
    """Counts the op results copied into the arena during a step (scratch of ops without out=)."""

    def __init__(self) -> None:
        self.count = 0


class NodePlacement:
    def __init__(self, values: dict[str, torch.Tensor], places: list[Callable | None] | None) -> None:
        self.values = values          # storage key -> uint8 tensor over its bytes of the arena
        self.places = places          # per op of the node's graph: what runs in its stead, or None


def place_node(arena: Arena, tensors: list[ArenaTensor], graph: StageProgram | None, copied: Copied) -> NodePlacement:
    values: dict[str, torch.Tensor] = {}
    by_op: dict[str, dict[int, torch.Tensor]] = {}
    for t in tensors:
        storage = arena.storage(t.offset, t.nbytes)
        if t.op:
            by_op.setdefault(t.op, {})[t.part] = storage
        else:
            values[t.name] = storage
    places = None
    if graph is not None and by_op:
        places = [_place_op(n, by_op.get(n.name), graph, copied) if n.op == "call_function" else None
                  for n in graph.body]
    return NodePlacement(values, places)


def _place_op(node: fx.Node, parts: dict[int, torch.Tensor] | None, graph: StageProgram,
              copied: Copied) -> Callable | None:
    """What runs in place of `node` so its results land in their arena tensors `parts`, or None."""
    if not parts:
        return None
    metas = tensors_of(node.meta.get("val"))
    inputs = graph.input_storage_keys()
    part_of: list[int] = []           # per result tensor, which of the op's storages it is on
    seen: dict = {}
    for m in metas:
        key = fake_storage_key(m)
        if key in inputs or not _static(m):
            return None               # a view of an input, or a size known only at run time
        part_of.append(seen.setdefault(key, len(seen)))
    empty = {p for p, m in zip(part_of, metas) if m.untyped_storage().nbytes() == 0}   # in no arena: no bytes
    if len(seen) != len(metas) or set(parts) != set(range(len(seen))) - empty:
        return None                   # results sharing a storage, or storages the plan did not place
    device = next(iter(parts.values())).device
    slots = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device) if p in empty
             else typed(parts[p], m) for p, m in zip(part_of, metas)]
    make = in_place_form(node)
    if make is not None:            # a factory or a cast: its one result is made where the plan put it
        slot, = slots

        def made(*args, **kwargs):
            make(slot, args, kwargs)
            return slot
        return made
    form = writes_into(node)
    if form is not None:
        overload, names = form
        outs = dict(zip(names, slots))

        def written(*args, **kwargs):
            return overload(*args, **kwargs, **outs)
        return written
    target = node.target

    def copied_in(*args, **kwargs):
        with outputs.into(slots):          # a fused kernel takes its results from here
            value = target(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(value)
        it = iter(slots)
        placed, wrote = [], False
        for x in leaves:
            if isinstance(x, torch.Tensor):
                slot = next(it)
                if not _is(x, slot):
                    slot.copy_(x.clone() if _shares(x, slot) else x)
                    wrote = True
                x = slot
            placed.append(x)
        copied.count += wrote
        return pytree.tree_unflatten(placed, spec)
    return copied_in


def _is(x: torch.Tensor, slot: torch.Tensor) -> bool:
    """x is the arena tensor itself (the kernel wrote its result there), layout and all."""
    if x.numel() == 0:
        return x.shape == slot.shape and x.dtype == slot.dtype
    return (x.data_ptr() == slot.data_ptr() and x.shape == slot.shape and x.stride() == slot.stride()
            and x.dtype == slot.dtype)


def _shares(x: torch.Tensor, slot: torch.Tensor) -> bool:
    return x.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()


def _static(meta: Any) -> bool:
    return all(isinstance(d, int) for d in (*meta.shape, *meta.stride(), meta.storage_offset()))
