"""Find the model's repeated decoder blocks: the stack that is traced once as a template."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class BlockStack:
    path: str                 # module path of the nn.ModuleList, e.g. "model.layers"
    blocks: tuple[nn.Module, ...]

    def block_path(self, i: int) -> str:
        return f"{self.path}.{i}" if self.path else str(i)


def _signature(module: nn.Module) -> tuple:
    """What must agree for two blocks to share one traced template. Which parameters train may
    differ: segment.py gives blocks with other trainable parameters their own template."""
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    classes = tuple(type(m).__name__ for m in module.modules())
    return type(module), params, buffers, classes


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The nn.ModuleList of identical modules holding the most parameters, or None.

    Blocks are identical when their class, submodule classes and parameter/buffer names,
    shapes and dtypes agree. A list of one module is no stack.
    """
    best, best_params = None, 0
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        first = _signature(module[0])
        if any(_signature(m) != first for m in module[1:]):
            continue
        n = sum(p.numel() for m in module for p in m.parameters())
        if n > best_params:
            best, best_params = BlockStack(path, tuple(module)), n
    return best
