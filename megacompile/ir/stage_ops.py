"""What runs for a stage graph node's target: the traced op itself, but for `aten.view`, which
becomes a copy where the real input's strides allow no view. The interpreter (stage_program.py)
and the generated code (stage_codegen.py) both call through `runnable`, so they run the same ops.
"""
from __future__ import annotations

import torch

_VIEW = torch.ops.aten.view.default


def view_or_copy(*args, **kwargs):
    """aten.view, or where the real input's strides allow none, a copy (reshape). Fake tensors
    predicted strides that allow a view; the real op before it chose others (a cat of two
    gradients laid out as transposes, in Qwen3-Next's gated delta-net backward). The copy holds
    the same values; it would differ from a view only for a later in-place write through it. Its
    bytes are counted where it is made, beyond what the plan predicted for a view."""
    try:
        return _VIEW(*args, **kwargs)
    except RuntimeError:
        return torch.ops.aten.reshape.default(*args, **kwargs)


def runnable(target):
    """What runs for a graph node's target."""
    return view_or_copy if target is _VIEW else target
