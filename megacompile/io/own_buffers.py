"""The buffers a model built itself, against the ones a checkpoint holds.

Training never writes a buffer (capture refuses models that do: capture/state_writes.py), so a
checkpoint's buffers are what the saving model's constructor made: rotary `inv_freq` from its
`rope_theta`, masks, position tables. A model built from another config makes other ones, and
restoring the checkpoint's would train a model that is not the one `model.config` describes. So
every buffer the model holds values for (not on meta) must equal the checkpoint's, to a tight
tolerance, or the load is refused naming it; with strict=False the model's own are kept. Buffers
the model has on meta (a model built without weights) have nothing to compare: they come from
the checkpoint.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from .source import CONST, Item

if TYPE_CHECKING:
    from ..state import TrainingState

# Two constructions of the same buffer agree to the last bit on one machine; this leaves room
# for another build of torch rounding a transcendental function differently, and no more.
RTOL, ATOL = 1e-6, 1e-12


def differing(state: "TrainingState", items: list[Item]) -> dict[str, str]:
    """Canonical name -> 'the checkpoint has ..., the model ...' for each buffer the model built
    itself whose value in the checkpoint differs. Reads those buffers alone, one at a time."""
    own = {state.canonical.get(n, n): b for n, b in state.model.named_buffers() if not b.is_meta}
    by_file: dict[str, list[Item]] = defaultdict(list)
    for it in items:
        if it.table == CONST and it.name in own:
            by_file[it.path].append(it)
    out = {}
    for path, file_items in by_file.items():
        with safe_open(path, framework="pt", backend="pread") as f:
            for it in file_items:
                saved, mine = f.get_tensor(it.key), own[it.name].detach()
                if not _same(saved, mine):
                    out[it.name] = f"the checkpoint has {summary(saved)}, the model {summary(mine)}"
    return out


def _same(saved: torch.Tensor, mine: torch.Tensor) -> bool:
    if saved.shape != mine.shape:
        return False
    if saved.is_floating_point() or mine.is_floating_point():
        return torch.allclose(saved.double(), mine.double(), rtol=RTOL, atol=ATOL, equal_nan=True)
    return torch.equal(saved, mine.to(saved.dtype))


def summary(t: torch.Tensor) -> str:
    """Enough of a tensor's values to see how two differ: its first entries, min, max and mean."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return "no values"
    head = ", ".join(f"{v:.6g}" for v in flat[:3].double().tolist())
    values = flat.double()
    return (f"[{head}{', ...' if flat.numel() > 3 else ''}] (min {values.min().item():.6g}, "
            f"max {values.max().item():.6g}, mean {values.mean().item():.6g})")
