"""The user's module comes out of a capture as it went in, whether the capture succeeded or raised.

Capturing swaps fake tensors into the module (torch.func.functional_call) and patches the blocks'
forward. functional_call puts the module's own tensors back once per path that reaches them, in
the order it took them: a module reached by several paths (`nn.ModuleList([b, b, b])`) gets the
fake tensor of its second path back, and the real weights are lost. So every module's own
parameters, buffers and instance-level `forward` are noted before and put back after: the same
objects, whatever ran in between.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

_ABSENT = object()


@contextlib.contextmanager
def as_it_was(model: nn.Module):
    kept = [(m, dict(m._parameters), dict(m._buffers), m.__dict__.get("forward", _ABSENT)) for m in model.modules()]
    try:
        yield
    finally:
        for module, params, buffers, forward in kept:
            for table, own in ((module._parameters, params), (module._buffers, buffers)):
                for name, t in own.items():
                    if table.get(name, _ABSENT) is not t:
                        table[name] = t
            if forward is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = forward
