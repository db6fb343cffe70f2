"""engine.load_state_dict: weights from dicts, whole or in parts (one shard at a time).

Each call checks its own tensors first (names, shapes, dtypes, finite values, none on meta) and
writes nothing if one is wrong. With host state, the tensors are copied into the masters (and
the compute copies) at once, so a model loaded shard by shard holds one shard beside the host
state at a time: call `prepare(...)` first to have it. Without host state (nothing traced yet:
the flat layout comes from the trace) the parts are kept, by reference, until the first step or
prepare() builds it.

Complete means every trainable parameter loaded and, for a model built on meta, every buffer
and frozen weight it holds no values for. `strict=True` (the default: one whole dict) requires the
call's own dict to be complete, whatever earlier calls loaded, and refuses a key that names nothing
of the model, as torch's does; load parts with strict=False, each of them. strict=False, as
torch's, skips keys that name nothing of the model. Both return torch's
`_IncompatibleKeys(missing_keys, unexpected_keys)`: the model's state_dict keys whose tensor the
call did not give (one name of a tied weight gives it) and the keys skipped. A model built on meta
whose parts are incomplete is refused at its first step or forward, naming what is missing. A
model with weights of its own may load any subset.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import MegacompileError
from ..runtime import HostState

if TYPE_CHECKING:
    from ..state import TrainingState

META_HINT = ("non-persistent buffers (rotary inv_freq) of a model built on meta must be passed too, or built "
             "real: construct the model with its parameters alone on meta (accelerate's init_empty_weights())")


class LoadedParts:
    """The partial loads of one engine: the names loaded so far and, before host state exists, the
    tensors waiting for it. Stands in the engine's pending load (the same apply(host, model))."""

    def __init__(self, before=None):
        self.loaded: set[str] = set()
        self.kept: dict[str, torch.Tensor] = {}
        self.before = before        # a pending load of files (from_pretrained) it goes after

    def apply(self, host: HostState, model=None) -> None:
        if self.before is not None:
            self.before.apply(host, model)
            self.before = None
        elif model is not None:
            _own_tensors(host, model, self)
        with torch.no_grad():
            host.load(self.kept)
        self.kept = {}


def load(state: "TrainingState", weights: dict, strict: bool = True) -> _IncompatibleKeys:
    if not isinstance(weights, dict):
        raise MegacompileError(f"load_state_dict takes a dict of tensors by parameter name, got {type(weights).__name__}")
    if not isinstance(strict, bool):
        raise MegacompileError(f"load_state_dict(strict=...) is True (the dict completes the weights) or False "
                               f"(one part of them); got {strict!r}")
    parts = state.weight_parts
    if parts is None:
        pending = state.pending_load
        parts = LoadedParts(before=pending if pending is not None and not isinstance(pending, LoadedParts) else None)
    trainable, const = _expected(state)
    names = {key: state.canonical.get(key, key) for key in weights}
    unexpected = [k for k, n in names.items() if n not in trainable and n not in const]
    names = {k: n for k, n in names.items() if k not in unexpected or strict}
    own = state.host if state.host is not None else checker(state, trainable)
    bad = [p for k, t in weights.items() if k in names and k not in unexpected
           for p in HostState.load_problems(own, {names[k]: t})]
    missing = sorted(set(required(state, trainable, const)) - set(names.values())) if strict else []
    if missing or bad or (unexpected and strict):
        raise MegacompileError(
            f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes, dtypes or values "
            f"{bad[:5]}; nothing was loaded"
            + (f" (strict=True: the dict must hold them all; load a model in parts with load_state_dict(part, "
               "strict=False) for each part)" if missing else "")
            + (" (strict=False skips keys that name nothing of the model)" if unexpected else "")
            + (f"; {META_HINT}" if any(n in const for n in missing) else ""))
    weights = {k: t for k, t in weights.items() if k in names}
    _refuse_conflicting_ties(weights, names)
    tensors = {names[k]: t for k, t in weights.items()}
    if state.host is not None:
        state.wait_updates()
        if not state.materialized and not parts.loaded:
            _own_tensors(state.host, state.model, parts)
        with torch.no_grad():
            state.host.load(tensors)
    else:
        parts.kept.update(tensors)      # they wait, with the parts, for the host state
    parts.loaded |= set(tensors)
    state.parts_loaded(parts, complete=state.materialized or not missing_names(state, parts))
    given = set(tensors)
    return _IncompatibleKeys([k for k, n in state.canonical.items() if n not in given], unexpected)


def _refuse_conflicting_ties(weights: dict, names: dict[str, str]) -> None:
    """Two keys of one tied tensor (lm_head.weight and model.embed_tokens.weight) hold one weight:
    given different values, either would be silently lost (torch keeps the one loaded last)."""
    first: dict[str, str] = {}
    for key, name in names.items():
        other = first.setdefault(name, key)
        if other == key:
            continue
        a, b = weights[other], weights[key]
        if a is not b and not torch.equal(a.detach(), b.detach().to(a.device, a.dtype)):
            raise MegacompileError(
                f"load_state_dict: {other} and {key} name one tied tensor, and the dict gives them different "
                f"values; nothing was loaded. Give the same tensor under both names, or only one of them "
                f"({other})")


def required(state: "TrainingState", trainable: dict, const: dict) -> list[str]:
    """What a complete load holds: every trainable parameter; for a model built on meta, also
    every buffer or frozen weight that is on meta in the model."""
    if state.materialized:
        return list(trainable)
    meta = {state.canonical.get(n, n) for n, t in list(state.model.named_parameters())
            + list(state.model.named_buffers()) if t.is_meta}
    return list(trainable) + [n for n in const if n in meta]


def missing_names(state: "TrainingState", parts: LoadedParts | None = None) -> list[str]:
    """What a complete load holds that `parts` (by default the state's) have not loaded."""
    trainable, const = _expected(state)
    parts = state.weight_parts if parts is None else parts
    loaded = parts.loaded if parts is not None else set()
    return sorted(set(required(state, trainable, const)) - loaded)


def missing_error(state: "TrainingState") -> MegacompileError:
    """The first step or forward of a model built on meta whose weights are not all loaded."""
    missing = missing_names(state)
    if state.weight_parts is None:
        return MegacompileError("the model was built on the meta device and has no weights: load them with "
                                "engine.load_state_dict(state_dict) before step() or a forward")
    const = _expected(state)[1]
    return MegacompileError(f"the model was built on the meta device and {len(missing)} of its tensors were never "
                            f"loaded: {', '.join(missing[:5])}; pass them to engine.load_state_dict before step() "
                            f"or a forward" + (f" ({META_HINT})" if any(n in const for n in missing) else ""))


def _expected(state: "TrainingState") -> tuple[dict, dict]:
    return state.layout()


def checker(state: "TrainingState", trainable: dict) -> SimpleNamespace:
    """What HostState.load_problems reads, before host state exists: shapes of the trainable
    parameters, the model's own tensors (meta or not: only shape and dtype are read) for the rest."""
    consts = {state.canonical.get(n, n): t for n, t in list(state.model.named_parameters())
              + list(state.model.named_buffers()) if state.canonical.get(n, n) not in trainable}
    return SimpleNamespace(slots={n: SimpleNamespace(shape=s) for n, s in trainable.items()}, consts=consts,
                           borrowed=frozenset())


def _own_tensors(host: HostState, model, parts: LoadedParts) -> None:
    """The model's own values first, where it has them: all of them for a model with weights, the
    real buffers of one built with its parameters on meta (rotary inv_freq computed by its
    constructor). Those need no loading."""
    real = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if (n in host.slots or n in host.consts) and not t.is_meta}
    with torch.no_grad():
        host.load(real)
    parts.loaded |= {n for n in real if n in host.consts}
