"""Which blocks of a stack are built alike, told from their modules without running them.

Running a block's forward under the op log (fingerprint.py) costs a few hundred fake-tensor ops,
about 0.1 s on a 2-core machine at 118B's shapes: 10 s for 104 blocks. Planning (never a training
capture) runs it only for the first two blocks and the last of each group of blocks whose modules
agree in everything but their layer number: the same classes nested the same way, the same
parameter and buffer names, shapes and dtypes, and the same attributes (values for numbers,
strings and flags; identity for other objects, so blocks sharing one config agree and blocks
holding their own callables do not; a function bound to the module itself, as capturing patches
experts modules, by the function; a function made for each module by one factory, as capturing
wraps the vision attention, by its code and what it holds). Any hook makes a block its own group.

The check behind it (top.py): a sampled block whose fingerprint differs from its group's first
makes the capture start again with every block logged. A difference only the unsampled middle
blocks read at run time (a config entry indexed by the layer number in forward, not stored on the
module) goes unseen; a training capture logs every block.
"""
from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn as nn

# Attributes that say which layer a module is, not what it computes (Hugging Face's `layer_idx`
# is read only by a KV cache, which training does not use).
_LAYER_NUMBER = {"layer_idx", "layer_id", "layer_number"}
_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def structure_key(block: nn.Module) -> tuple:
    """A value two blocks share when their modules are built alike (see the module's docstring)."""
    parts = []
    for path, m in block.named_modules():
        attrs = tuple((k, _value(v, m)) for k, v in sorted(vars(m).items())
                      if k not in _STATE and k not in _LAYER_NUMBER)
        params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m._parameters.items()
                       if p is not None)
        buffers = tuple((n, tuple(b.shape), b.dtype, n in m._non_persistent_buffers_set)
                        for n, b in m._buffers.items() if b is not None)
        parts.append((path, type(m), attrs, params, buffers))
    return tuple(parts)


def _value(v: Any, owner: nn.Module | None = None) -> Any:
    if v is None or isinstance(v, (bool, int, str, torch.dtype, torch.device)):
        return v
    if isinstance(v, types.MethodType) and v.__self__ is owner:
        # A function bound to the module itself (a forward patched per instance, as capturing does
        # to experts modules): the same function is the same code over the same module.
        return ("own method", id(v.__func__))
    if isinstance(v, types.FunctionType):
        # A function made for each module by one factory (capturing wraps the vision attention's
        # forward so: vision_chunks.py): the same code over values alike is the same function.
        return ("function", v.__code__, _value(v.__defaults__, owner), _value(v.__kwdefaults__, owner),
                tuple(_value(_cell(c), owner) for c in v.__closure__ or ()))
    if isinstance(v, float):
        return ("float", v.hex() if math.isfinite(v) else repr(v))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value(x, owner) for x in v))
    if isinstance(v, dict):
        # Empty hook dicts compare equal; a hook, held by identity, sets its block apart.
        return ("dict", tuple((repr(k), _value(x, owner)) for k, x in v.items()))
    return ("object", id(v))


def _cell(cell) -> Any:
    try:
        return cell.cell_contents
    except ValueError:      # a cell not yet filled
        return ("empty cell",)


def sampled_groups(blocks: list[nn.Module]) -> tuple[dict[int, int], dict[int, int]]:
    """For planning: (block index -> the first block of its group) for the blocks that need not be
    logged, all but the first two and the last of each group of blocks built alike; and the same
    for the second and the last, whose fingerprints check the group."""
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(structure_key(b), []).append(i)
    skip: dict[int, int] = {}
    checks: dict[int, int] = {}
    for members in groups.values():
        if len(members) < 4:
            continue
        skip.update((i, members[0]) for i in members[2:-1])
        checks[members[1]] = checks[members[-1]] = members[0]
    return skip, checks
