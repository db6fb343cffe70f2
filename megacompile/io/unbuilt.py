"""The state of an engine that has not built its host state yet (no step or prepare() so far: the
flat buffers' layout comes from the first trace), one tensor at a time, for saves and exports.

Each tensor is a `Lazy`: its shape and dtype now, its values when called, read from where they
are -- the weight files of a pending from_pretrained or load_checkpoint (a fused expert weight
assembled from its per-expert tensors), the parts given to load_state_dict, or the model's own
tensors -- and cast to fp32 for the trainable ones, as the masters would hold them. AdamW's
moments are zeros until a checkpoint (or engine.torch_optimizer.load_state_dict) says otherwise.
Only the tensor being written is in memory.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from safetensors import safe_open

from ..errors import MegacompileError
from .source import CONST, MASTER, TABLES, WEIGHT, PendingLoad

if TYPE_CHECKING:
    from ..state import TrainingState


class Lazy:
    def __init__(self, shape: tuple, dtype: torch.dtype, produce: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self._produce = torch.Size(shape), dtype, produce

    def numel(self) -> int:
        return self.shape.numel()

    def __call__(self) -> torch.Tensor:
        return self._produce()


def refuse_missing_weights(state: "TrainingState") -> None:
    """A model built on meta whose weights are not all loaded has none to save: the host state a
    prepare() or a refused first step built holds uninitialised memory until they are loaded."""
    if state.materialized:
        return
    from .state_dict import missing_names
    raise MegacompileError(f"the model has no weights for {', '.join(missing_names(state)[:4])} yet (built on "
                           "meta): load them (load_state_dict, load_checkpoint) before saving")


def state_tensors(state: "TrainingState") -> Iterator[tuple[str, torch.Tensor]]:
    """(state_dict key, tensor), one at a time and not copied: views of the host state, or before
    it exists, read from where the weights wait. A model built on meta is refused until its weights
    are complete, whether or not a prepare() or a refused step built the host state."""
    if not state.materialized:
        raise MegacompileError("no weights yet: the model was built on the meta device; load them "
                               "(engine.load_state_dict, engine.load_checkpoint) before reading engine.state_dict()")
    if state.host is not None:
        state.wait_updates()
        try:
            for key, name in state.canonical.items():
                if name in state.host.slots:
                    yield key, state.host.master(name)
                elif name in state.host.consts:
                    yield key, state.host.consts[name]
        finally:
            # Masters on disk are read an owner at a time and the last one kept (DiskState.read):
            # let it go once the pass is over, so no owner's masters stay in RAM after it.
            if state.host.disk is not None:
                state.host.disk.settle()
        return
    trainable, consts = tables(state)
    for key, name in state.canonical.items():
        lazy = trainable["master"].get(name) or consts.get(name)
        if lazy is not None:
            yield key, lazy()


def tables(state: "TrainingState") -> tuple[dict[str, dict[str, Lazy]], dict[str, Lazy]]:
    """({master, exp_avg, exp_avg_sq, grad} -> {name: Lazy} for the trainable parameters,
    {name: Lazy} for buffers and frozen weights)."""
    from .state_dict import LoadedParts
    trainable, const = state.layout()
    own = {state.canonical.get(n, n): t for n, t in list(state.model.named_parameters())
           + list(state.model.named_buffers())}
    sources: dict[str, dict[str, Callable]] = defaultdict(dict)
    for name, t in own.items():
        if not t.is_meta and (state.materialized or name in const):
            sources[MASTER][name] = lambda t=t: t.detach()
    pending, kept = state.pending_load, {}
    if isinstance(pending, LoadedParts):
        pending, kept = pending.before, pending.kept
    if isinstance(pending, PendingLoad):
        by_name = defaultdict(list)
        for it in pending.items:
            by_name[(MASTER if it.table in (WEIGHT, CONST) else it.table, it.name)].append(it)
        memory = pending.memory or {}
        for (table, name), items in by_name.items():
            sources[table][name] = lambda items=items, name=name: _read(items, trainable.get(name) or const[name],
                                                                        memory)
    for name, t in kept.items():
        sources[MASTER][name] = lambda t=t: t
    moments = state.pending_moments     # engine.torch_optimizer.load_state_dict's, after any checkpoint's
    if isinstance(moments, PendingLoad):
        for it in moments.items:
            sources[it.table][it.name] = lambda it=it: moments.memory[it.path][it.key]
    out: dict[str, dict[str, Lazy]] = {}
    missing = [n for n in trainable if n not in sources[MASTER]]
    if missing:
        raise MegacompileError(f"the model has no weights for {', '.join(missing[:4])} yet (built on meta): load "
                               "them (load_state_dict, load_checkpoint) before saving")
    for table in (MASTER,) + TABLES:
        out[table] = {n: Lazy(shape, torch.float32, _fp32(sources[table].get(n), shape))
                      for n, shape in trainable.items() if table != "grad" or n in sources["grad"]}
    consts = {n: Lazy(shape, own[n].dtype, sources[MASTER][n]) for n, shape in const.items() if n in sources[MASTER]}
    return out, consts


def _fp32(produce: Callable | None, shape: tuple) -> Callable[[], torch.Tensor]:
    if produce is None:   # a moment nothing has written: zero, as AdamW starts
        return lambda: torch.zeros(shape)
    return lambda: produce().to(torch.float32)


def _read(items: list, shape: tuple, memory: dict) -> torch.Tensor:
    """One tensor from its file (or from `memory`, PendingLoad's tensors held in memory), or a fused
    expert weight from its per-expert tensors."""
    from .hf_layout import part_of
    if len(items) == 1 and items[0].path in memory:
        return memory[items[0].path][items[0].key]
    if len(items) == 1 and items[0].part is None:
        with safe_open(items[0].path, framework="pt", backend="pread") as f:
            return f.get_tensor(items[0].key)
    out = torch.empty(shape, dtype=torch.float32)
    for it in items:
        with safe_open(it.path, framework="pt", backend="pread") as f:
            part_of(out, it.part).copy_(f.get_tensor(it.key))
    return out
