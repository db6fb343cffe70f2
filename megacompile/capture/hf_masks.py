"""Hugging Face causal masks under capture: attention with is_causal, no [B, 1, S, S] tensor.

Run eagerly without an attention_mask, a transformers decoder builds no mask: it checks that its
position_ids (which it makes itself, 0..S-1) hold one sequence per row, not several packed ones,
and then calls SDPA with is_causal=True. Under fake tensors that check cannot read the values, so
transformers assumes packed sequences could be present and builds a [B, 1, S, S] boolean mask in
the prologue; every block then turns it into an additive mask (2*B*S^2 bytes in bf16, 512 MiB at
16 x 4096) that its attention saves for the backward, and an explicit mask rules out the flash
kernels on a GPU.

What capture does know is whether the caller passed position_ids. When it did not, the model
made them from its input length, so they are consecutive and the check's answer is known: no
packing. `causal_attention_without_mask` gives transformers that answer for the duration of the
trace, and the model traces the path it runs eagerly. A caller's own position_ids (which may
pack sequences) give packed documents, which hf_windows.py turns into each token's document start,
and an attention_mask (whose values are unknown, all ones or not) becomes the keys each row keeps;
a mask that stays is recomputed by each block from what it derives from it (split.py).
"""
from __future__ import annotations

import contextlib
import inspect
import sys

import torch.nn as nn


def _passes_position_ids(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    if kwargs.get("position_ids") is not None:
        return True
    try:
        bound = inspect.signature(model.forward).bind_partial(*args).arguments
    except (TypeError, ValueError):
        return bool(args)   # where the positional arguments go is unknown: they may be positions
    return bound.get("position_ids") is not None


@contextlib.contextmanager
def causal_attention_without_mask(model: nn.Module, args: tuple, kwargs: dict):
    """While tracing `model(*args, **kwargs)`: transformers' packed-sequence check answers "one
    sequence per row" when the model makes its own position_ids. A no-op for other models."""
    masking = sys.modules.get("transformers.masking_utils")
    check = getattr(masking, "find_packed_sequence_indices", None)
    is_hf = any(type(m).__module__.startswith("transformers.") for m in model.modules())
    if check is None or not is_hf or _passes_position_ids(model, args, kwargs):
        yield
        return

    def one_sequence_per_row(position_ids):
        return None

    masking.find_packed_sequence_indices = one_sequence_per_row
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = check
