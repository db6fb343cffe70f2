"""While capturing: transformers' gated delta rule becomes megacompile::chunk_gated_delta_rule.

Qwen3-Next's and Qwen3.5's gated delta-nets call `torch_chunk_gated_delta_rule`, a function of
their modeling module, by its global name. For the capture that name holds a router: a call as
training makes it (no recurrent state in or out, no packed-sequence lengths) becomes the one
operator of linear_attention/delta_rule.py, which runs the module's own function when the step
runs; any other call (a cache, packed-sequence `cu_seqlens`, a chunk size of its own) runs the
function as it is, traced op by op as before.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
import torch.nn as nn

from ..linear_attention.delta_rule import FUNCTION, remember
from .refuse import CHECKED_LINEAR_ATTENTION


# Keywords the decoder layers pass through to the rule and the rule does not read.
_IGNORED = {"cu_seqlens", "use_cache", "output_router_logits", "output_attentions", "output_hidden_states",
            "return_dict"}


def _router(module: str, original: Callable) -> Callable:
    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kwargs):
        # The layers hand on their own keywords too, which the rule ignores; any other keyword
        # (packed-sequence lengths, a chunk size) keeps the call as it is.
        if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None \
                or not set(kwargs) <= _IGNORED:
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kwargs)
        out = torch.ops.megacompile.chunk_gated_delta_rule(query, key, value, g, beta, module,
                                                           bool(use_qk_l2norm_in_kernel))
        return out, None
    return rule


@contextlib.contextmanager
def delta_rule_as_op(model: nn.Module):
    """While inside: the modeling modules of `model`'s gated delta-nets route their rule here."""
    names = {type(m).__module__ for m in model.modules() if type(m).__name__ in CHECKED_LINEAR_ATTENTION}
    patched = []
    for name in sorted(names):
        module = sys.modules.get(name)
        original = getattr(module, FUNCTION, None)
        if original is None:
            continue
        remember(name, original)
        setattr(module, FUNCTION, _router(name, original))
        patched.append((module, original))
    try:
        yield
    finally:
        for module, original in patched:
            setattr(module, FUNCTION, original)
