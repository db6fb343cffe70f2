"""Values a block hands to the rest of the model through forward hooks, not through its return value.

A transformers MoE model asked for its router logits (`output_router_logits`, which the
load-balancing loss reads) records them with forward hooks on each layer's router: every hook
appends to a collector that the model's forward set up, and the epilogue reads the collected
list. The block's own return value does not carry them. Traced as a leaf, a block would leak its
fake logits into the top-level graph; so, while a block runs, the hooks record into a collector
of the block's own, and what they recorded becomes extra outputs of the block ("side outputs"),
which the top-level trace hands back to the model's collector in the same order.

The collector is transformers' `_active_collector` (utils/output_capturing.py): a dict from
a key ("router_logits", "attentions", ...) to the list of recorded values.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

import torch


def _collector():
    module = sys.modules.get("transformers.utils.output_capturing")
    return getattr(module, "_active_collector", None)


def active_keys() -> tuple[str, ...]:
    """The keys the model's collector records right now (none outside a recording forward)."""
    var = _collector()
    outer = var.get() if var is not None else None
    return tuple(k for k, v in (outer or {}).items() if isinstance(v, list))


@dataclass
class Recorded:
    keys: tuple[str, ...]                                         # the keys recorded while the block ran
    values: list[tuple[str, object]] = field(default_factory=list)  # (key, value) in recording order

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [v for _, v in self.values if isinstance(v, torch.Tensor)]

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        return tuple(k for k, v in self.values if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def recording(keys: tuple[str, ...]):
    """Within: the hooks record `keys` into a collector of their own; yields the Recorded filled on exit."""
    var = _collector()
    recorded = Recorded(keys)
    if var is None or not keys:
        yield recorded
        return
    outer = var.get()
    inner = {k: [] for k in keys}
    if outer:
        inner.update({k: v for k, v in outer.items() if not isinstance(v, list)})   # selections
    token = var.set(inner)
    try:
        yield recorded
    finally:
        var.reset(token)
        # Within one key the order is the recording order; the keys do not interleave.
        recorded.values = [(k, v) for k in keys for v in inner[k]]


def hand_back(recorded: Recorded, tensors: list[torch.Tensor]) -> None:
    """Append what the block recorded to the model's collector, its tensors replaced by `tensors`."""
    var = _collector()
    outer = var.get() if var is not None else None
    if not outer:
        return
    it = iter(tensors)
    for key, value in recorded.values:
        outer[key].append(next(it) if isinstance(value, torch.Tensor) else value)
