"""engine.load_state_dict: weights from dicts, whole or in parts (one shard at a time).

Each call checks its own tensors first (names, shapes, dtypes, finite values, none on meta) and
writes nothing if one is wrong. With host state, the tensors are copied into the masters (and
the compute copies) at once, so a model loaded shard by shard holds one shard beside the host
state at a time: call `prepare(...)` first to have it. Without host state (nothing traced yet:
the flat layout comes from the trace) the parts are kept, by reference, until the first step or
prepare() builds it.

Complete means every trainable parameter loaded and, for a model built on meta, every buffer
and frozen weight it holds no values for. `strict=True` (the default: one whole dict) checks it
once the call's own tensors are counted: pass the last part with strict=True, or end with
`load_state_dict({})`. A model built on meta whose parts are incomplete is refused at its first
step or forward, naming what is missing. A model with weights of its own may load any subset.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from ..errors import MegacompileError
from ..runtime import HostState

if TYPE_CHECKING:
    from ..engine import Engine

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


def load(engine: "Engine", state: dict, strict: bool = True) -> None:
    if not isinstance(state, dict):
        raise MegacompileError(f"load_state_dict takes a dict of tensors by parameter name, got {type(state).__name__}")
    if not isinstance(strict, bool):
        raise MegacompileError(f"load_state_dict(strict=...) is True (the dict completes the weights) or False "
                               f"(one part of them); got {strict!r}")
    parts = engine._weight_parts
    if parts is None:
        pending = engine._pending_load
        parts = LoadedParts(before=pending if pending is not None and not isinstance(pending, LoadedParts) else None)
    trainable, const = _expected(engine)
    names = {key: engine._canonical.get(key, key) for key in state}
    unexpected = [k for k, n in names.items() if n not in trainable and n not in const]
    own = engine.host if engine.host is not None else checker(engine, trainable)
    bad = [p for k, t in state.items() if names[k] not in unexpected
           for p in HostState.load_problems(own, {names[k]: t})]
    missing = sorted(set(required(engine, trainable, const)) - parts.loaded - set(names.values())) if strict else []
    if missing or bad or unexpected:
        raise MegacompileError(
            f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shapes, dtypes or values "
            f"{bad[:5]}; nothing was loaded"
            + (f" (the {len(missing)} missing ones may come in other parts: load_state_dict(part, strict=False) "
               "for each but the last)" if missing else "")
            + (f"; {META_HINT}" if any(n in const for n in missing) else ""))
    tensors = {names[k]: t for k, t in state.items()}
    if engine.host is not None:
        engine._wait_updates()
        if not engine._materialized and not parts.loaded:
            _own_tensors(engine.host, engine.model, parts)
        with torch.no_grad():
            engine.host.load(tensors)
    else:
        parts.kept.update(tensors)
        engine._pending_load = parts
    parts.loaded |= set(tensors)
    engine._weight_parts = parts
    if not engine._materialized and not missing_names(engine):
        engine._materialized = True


def required(engine: "Engine", trainable: dict, const: dict) -> list[str]:
    """What a complete load holds: every trainable parameter; for a model built on meta, also
    every buffer or frozen weight that is on meta in the model."""
    if engine._materialized:
        return list(trainable)
    meta = {engine._canonical.get(n, n) for n, t in list(engine.model.named_parameters())
            + list(engine.model.named_buffers()) if t.is_meta}
    return list(trainable) + [n for n in const if n in meta]


def missing_names(engine: "Engine") -> list[str]:
    trainable, const = _expected(engine)
    loaded = engine._weight_parts.loaded if engine._weight_parts is not None else set()
    return sorted(set(required(engine, trainable, const)) - loaded)


def missing_error(engine: "Engine") -> MegacompileError:
    """The first step or forward of a model built on meta whose weights are not all loaded."""
    missing = missing_names(engine)
    if engine._weight_parts is None:
        return MegacompileError("the model was built on the meta device and has no weights: load them with "
                                "engine.load_state_dict(state_dict) before step() or a forward")
    const = _expected(engine)[1]
    return MegacompileError(f"the model was built on the meta device and {len(missing)} of its tensors were never "
                            f"loaded: {', '.join(missing[:5])}; pass them to engine.load_state_dict before step() "
                            f"or a forward" + (f" ({META_HINT})" if any(n in const for n in missing) else ""))


def _expected(engine: "Engine") -> tuple[dict, dict]:
    from .checkpoint import expected_state
    return expected_state(engine)


def checker(engine: "Engine", trainable: dict) -> SimpleNamespace:
    """What HostState.load_problems reads, before host state exists: shapes of the trainable
    parameters, the model's own tensors (meta or not: only shape and dtype are read) for the rest."""
    consts = {engine._canonical.get(n, n): t for n, t in list(engine.model.named_parameters())
              + list(engine.model.named_buffers()) if engine._canonical.get(n, n) not in trainable}
    return SimpleNamespace(slots={n: SimpleNamespace(shape=s) for n, s in trainable.items()}, consts=consts)


def _own_tensors(host: HostState, model, parts: LoadedParts) -> None:
    """The model's own values first, where it has them: all of them for a model with weights, the
    real buffers of one built with its parameters on meta (rotary inv_freq computed by its
    constructor). Those need no loading."""
    real = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if (n in host.slots or n in host.consts) and not t.is_meta}
    with torch.no_grad():
        host.load(real)
    parts.loaded |= {n for n in real if n in host.consts}
