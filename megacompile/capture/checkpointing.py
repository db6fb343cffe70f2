"""Hugging Face gradient checkpointing is off while capturing: megacompile plans recompute itself.

After `model.gradient_checkpointing_enable()` each layer's forward runs under
torch.utils.checkpoint, whose backward runs the forward again once the capture has put the
module's own weights back: the trace would meet real tensors where it holds fakes. What
checkpointing asks for, activations recomputed instead of saved, is the planner's choice here
(passes/remat.py, the blocks' selective variant), and it changes no value: checkpoint replays the
layer with the random state it first ran with. So the layers are traced as they run without it,
and each module's flag is set back afterwards.
"""
from __future__ import annotations

import contextlib

import torch.nn as nn

_ABSENT = object()


@contextlib.contextmanager
def without_gradient_checkpointing(model: nn.Module):
    flagged = [(m, m.__dict__.get("gradient_checkpointing", _ABSENT)) for m in model.modules()
               if getattr(m, "gradient_checkpointing", False) is True]
    try:
        for m, _ in flagged:
            m.gradient_checkpointing = False
        yield
    finally:
        for m, own in flagged:
            if own is _ABSENT:
                del m.gradient_checkpointing      # back to the class's True
            else:
                m.gradient_checkpointing = own
