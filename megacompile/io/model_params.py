"""The user's module and the engine's state: a stale copy must never pass as the trained model.

The engine trains its own fp32 masters (runtime/host.py). Where the module was built with real
fp32 weights, its parameters become views of the masters when the host state is built (and its
frozen weights and buffers views of the host state's copies): one copy of the weights in the
process, read as they are once the running updates are done. Module tensors that cannot be views
(a bf16 module, masters on the disk tier, data parallelism) keep the values the module was built
with, and are brought up to date -- the masters copied into them, cast to their dtype -- at the points a user reads them: `engine.synchronize()`,
`engine.close()`, and `model.state_dict()` itself (so `model.save_pretrained()` too), through a
state_dict pre-hook. The module's tensors already take their bytes of host memory; updating them
takes none, and it happens only where the state changed since the last update (a step, a load).
Where the module has its parameters on meta (from_pretrained, or a model built without weights)
there is nothing to update, and `model.state_dict()` is refused, naming the engine's own way. With
data parallelism each rank holds only a share of the masters (and gathering one is a collective
that every rank must join), so `model.state_dict()` is refused there too.
"""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ..errors import MegacompileError
from . import unbuilt

if TYPE_CHECKING:
    from ..state import TrainingState


# The engine whose host state the module's tensors are views of (lend): a module compiled again
# lends them to the newer engine, and the older one must not write its masters into them.
_LENDER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def lend(state: "TrainingState") -> None:
    """Make the module's tensors views of the state's host buffers (runtime/host.py
    lend_to_module); from now on this engine alone writes into them or loads through them."""
    state.host.lend_to_module(state.model)
    _LENDER[state.model] = weakref.ref(state)


def _feeds(state: "TrainingState") -> bool:
    """Whether the module is this engine's to update: no engine lent it tensors, or this one did."""
    lender = _LENDER.get(state.model)
    return lender is None or lender() is None or lender() is state


def attach(state: "TrainingState") -> None:
    """model.state_dict() reads the engine's state from now on (a weak reference: the hook does not
    keep the engine alive, and does nothing once it is gone)."""
    ref = weakref.ref(state)

    def before_state_dict(module, prefix, keep_vars) -> None:
        owner = ref()
        if owner is not None and owner.model is module and not keep_vars and _feeds(owner):
            check_readable(owner)
            write_back(owner)
    state.model.register_state_dict_pre_hook(before_state_dict)

    def before_load_state_dict(module, values, prefix, *rest) -> None:
        # The module's tensors are views of the masters (or compute copies): a load into them alone
        # would change one and not the other. It goes through the engine's load first (checked,
        # masters and compute copies together); the module's own copy then writes the same values.
        owner = ref()
        if owner is not None and owner.model is module and not prefix and owner.host is not None \
                and owner.data_parallel is None and _feeds(owner):
            from .state_dict import load
            load(owner, dict(values), strict=rest[1])     # counted as a load by the state itself
    state.model.register_load_state_dict_pre_hook(before_load_state_dict)


def check_readable(state: "TrainingState") -> None:
    """Refuse a read of the module's weights where they are not the engine's (keep_vars reads, which
    the engine's own capture makes, pass: they take the parameter objects, not their values)."""
    if state.data_parallel is not None and (state.host is not None or state.pending_load is not None
                                            or state.weight_parts is not None):
        raise MegacompileError(
            "model.state_dict() reads the module's own parameters, and with data parallelism each rank's "
            "engine holds only its share of the trained ones: call engine.state_dict() on every rank (it "
            "gathers them) or engine.save_pretrained(path)")
    meta = [n for n, p in state.model.named_parameters() if p.is_meta]
    if meta:
        raise MegacompileError(
            f"model.state_dict() reads the module's own parameters, and {len(meta)} of them ({', '.join(meta[:3])}) "
            "are on the meta device: the weights live in the engine (the model was built without them); read "
            "engine.state_dict(), or write a Hugging Face folder with engine.save_pretrained(path)")


def synchronize(state: "TrainingState") -> None:
    """Wait for host updates still running, and bring the module's own parameters up to date."""
    state.wait_updates()
    write_back(state)


def write_back(state: "TrainingState") -> None:
    """Copy the engine's masters (and buffers) into the module's real tensors, if they changed
    since the last copy (reading them waits for the running updates first)."""
    version = state.counters.weights_version     # what changes whenever the masters do
    if state.data_parallel is not None or state.module_version == version or not _feeds(state):
        return
    if state.host is None and state.pending_load is None and state.weight_parts is None:
        state.module_synchronized(version)       # the module's own weights are the state
        return
    own = state.model.state_dict(keep_vars=True)
    # A module tensor that is a view of the state (runtime/host.py lend_to_module) is up to date
    # once the updates are done; only the module's own tensors take a copy. With none (a model on
    # meta, every weight lent) no state tensor is read: with masters on disk that read is a pass
    # over the disk tier.
    state.wait_updates()
    if any(not t.is_meta and not _lent(state, key, t) for key, t in own.items()):
        with torch.no_grad():
            for key, t in unbuilt.state_tensors(state):      # one tensor at a time, no copy of the state
                if key in own and not own[key].is_meta and own[key].data_ptr() != t.data_ptr():
                    own[key].copy_(t)
    state.module_synchronized(version)


def _lent(state: "TrainingState", key: str, t: torch.Tensor) -> bool:
    return state.host is not None and state.host.lent(state.canonical.get(key, key), t)


def own_bytes(state: "TrainingState") -> int:
    """Host bytes the module's own tensors hold apart from the state (not lent, not on meta)."""
    seen, total = set(), 0
    for key, t in state.model.state_dict(keep_vars=True).items():
        if t.is_meta or t.device.type != "cpu" or _lent(state, key, t) or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.untyped_storage().nbytes()
    return total
