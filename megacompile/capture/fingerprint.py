"""What one block computes, as a value two blocks can compare: its ATen ops and their dataflow.

Blocks share one traced template only when they compute the same thing. Their modules can agree
in every parameter and still differ: a Python flag read in forward (rotary off in some layers), a
per-layer scalar (`self.alpha = i + 1`), `GELU()` against `GELU(approximate="tanh")`, a config
entry indexed by the layer number. The top-level trace already runs every block's own forward on
fake tensors (to learn its output shapes); `record()` watches that run below autograd and logs
each ATen op with its non-tensor arguments, and each tensor argument as where it comes from (a
block input, a block-local parameter or buffer, an earlier op's output) with its shape and dtype.
Where a block's backward runs Python the forward ops do not show (a custom autograd.Function, a
gradient hook), the backward runs under the log too, on fake tangents.

Attributes that change nothing the block computes (Hugging Face's per-layer `layer_idx`, read only
by a KV cache that training does not use) leave the fingerprint alone, so a stack of identical
layers keeps one template whatever its depth.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import BackwardCFunction
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

Fingerprint = tuple
_CONSTANT_NUMEL = 4096     # real constants up to this size are compared by value


class _OpLog(TorchDispatchMode):
    """Every ATen op below autograd, with each tensor named by where it comes from."""

    def __init__(self):
        super().__init__()
        self.names: dict[int, tuple] = {}    # id(tensor) -> where it comes from
        self.keep: list[torch.Tensor] = []   # holds every named tensor, so no id is reused
        self.ops: list[tuple] = []

    def name(self, t: torch.Tensor, token: tuple) -> None:
        self.names[id(t)] = token
        self.keep.append(t)

    def token(self, t: torch.Tensor) -> tuple:
        name = self.names.get(id(t))
        if name is None:
            name = self._outside(t)
        return (name, t.shape, t.dtype)

    @staticmethod
    def _outside(t: torch.Tensor) -> tuple:
        # A real tensor made in forward (`torch.tensor(2.0)`, new in every block) is known by its
        # values; any other tensor from outside the block (a closure, a large global) by its
        # identity: two blocks reading different ones must not share a template.
        if not isinstance(t, FakeTensor) and t.device.type != "meta" and t.numel() <= _CONSTANT_NUMEL:
            with _disable_current_modes():
                return ("constant", tuple(t.detach().flatten().tolist()))
        return ("outside", id(t))

    def describe(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.token(x)
        if isinstance(x, (tuple, list)):
            return tuple(self.describe(y) for y in x)
        if isinstance(x, float):
            return ("float", x.hex() if math.isfinite(x) else repr(x))
        if x is None or isinstance(x, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                        torch.memory_format)):
            return x
        return (type(x).__name__, repr(x))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        entry = (func, self.describe(args), tuple((k, self.describe(v)) for k, v in kwargs.items()))
        out = func(*args, **kwargs)
        index = len(self.ops)
        self.ops.append(entry)
        for j, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.name(t, ("op", index, j))
        return out


def record(block: nn.Module, run, tensors: list[torch.Tensor], train: bool,
           attached: dict[str, torch.Tensor] | None = None) -> tuple[Any, Fingerprint]:
    """Run `run(tensors)` (the block's own forward on its tensor inputs) under the op log and
    return its output and the block's fingerprint.

    In training the forward runs with autograd on, so the graph it builds can be read: where it
    holds a custom autograd.Function or a gradient hook, Python code that the forward ops do not
    show runs in the backward, and the backward runs under the log too. Otherwise the backward is
    the derivative of the logged ops and adds nothing to compare. `attached`: the tensors of work
    folded into the block (deepstack.py), by their names inside its stage."""
    log = _OpLog()
    for kind, named in (("param", block.named_parameters()), ("buffer", block.named_buffers()),
                        ("param", (attached or {}).items())):
        for n, p in named:
            log.name(p, (kind, n))
    inputs = []
    for k, t in enumerate(tensors):
        # Detached, so the block's autograd graph starts at its own inputs.
        x = t.detach().requires_grad_(train and t.requires_grad)
        log.name(x, ("input", k))
        inputs.append(x)
    with torch.set_grad_enabled(train), log:
        out = run(inputs)
        outs = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
        results = tuple(log.token(x) for x in outs)
        heads = [x for x in outs if x.requires_grad]
        grads: tuple = ()
        if heads and _python_in_backward(heads, log.keep):
            wrt = [x for x in inputs if x.requires_grad] + [p for p in block.parameters() if p.requires_grad]
            tangents = [torch.empty_like(x) for x in heads]
            for k, g in enumerate(tangents):
                log.name(g, ("tangent", k))
            got = torch.autograd.grad(heads, wrt, tangents, allow_unused=True)
            grads = tuple(None if g is None else log.token(g) for g in got)
    return out, (tuple(log.ops), results, grads)


def _python_in_backward(heads: list[torch.Tensor], tensors: list[torch.Tensor]) -> bool:
    """Whether the autograd graph behind `heads` runs Python of the model's own in the backward:
    a custom autograd.Function (module backward hooks are one too) or a tensor hook."""
    if any(getattr(t, "_backward_hooks", None) for t in tensors):
        return True
    seen: set = set()
    stack = [x.grad_fn for x in heads]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, BackwardCFunction):
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False
