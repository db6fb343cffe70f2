"""A tracing-only operator that stands for one whole decoder block in the top-level graph.

The top-level trace records `megacompile::block_call(inputs, index)` where the model calls a
block, instead of the block's few hundred ATen ops: the template is traced once on its own
(capture/stage.py), so tracing time does not grow with depth.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError


@dataclass
class BlockCall:
    """How the model called one block: the argument tree with its tensors taken out."""
    in_spec: pytree.TreeSpec
    constants: list[Any]          # non-tensor leaves (None for tensor positions)
    tensor_positions: list[int]   # leaf indices that are tensors, in op-input order
    out_spec: pytree.TreeSpec
    out_meta: list[tuple[torch.Size, torch.dtype, torch.device] | None]  # None: non-tensor leaf
    out_constants: list[Any]
    index: int = 0                # which block of the stack was called
    fingerprint: tuple = ()       # what the block computed (fingerprint.py)
    # Tensors the block's forward hooks recorded (side_outputs.py): extra outputs after the
    # returned ones, with the collector keys active while it ran and the key of each tensor.
    collect_keys: tuple[str, ...] = ()
    side_keys: tuple[str, ...] = ()
    # Work the model runs on the block's output before the next block (deepstack.py): its extra
    # tensor inputs follow the call's own; the outputs it adds follow the side outputs.
    attached: Any = None
    attached_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = field(default_factory=list)

    @property
    def attached_key(self) -> str | None:
        return None if self.attached is None else self.attached.key

    def rebuild_args(self, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
        leaves = list(self.constants)
        for pos, t in zip(self.tensor_positions, tensors):
            leaves[pos] = t
        return pytree.tree_unflatten(leaves, self.in_spec)

    def rebuild_output(self, tensors: list[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if m is not None else c for m, c in zip(self.out_meta, self.out_constants)]
        return pytree.tree_unflatten(leaves, self.out_spec)


# Output metadata per block index, read by the fake kernel while the top-level trace runs.
_OUT_META: dict[int, list[tuple[torch.Size, torch.dtype, torch.device]]] = {}


@torch.library.custom_op("megacompile::block_call", mutates_args=())
def block_call(inputs: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    raise CaptureError("megacompile::block_call stands for a block while tracing and never runs")


@block_call.register_fake
def _block_call_fake(inputs: list[torch.Tensor], index: int) -> list[torch.Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in _OUT_META[index]]


def set_out_meta(index: int, meta: list) -> None:
    _OUT_META[index] = meta


def clear_out_meta() -> None:
    _OUT_META.clear()
