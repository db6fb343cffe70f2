"""Models megacompile cannot train exactly yet, refused before tracing with the reason.

docs/families.md lists them. A refusal names the module that triggers it.
"""
from __future__ import annotations

import re

import torch.nn as nn

from ..errors import CaptureError
from ..moe.experts import is_hf_experts

# Experts kept any other way than transformers' fused 3D weights (a ModuleList of expert MLPs,
# DBRX's, Llama 4's, JetMoE's): their forward loops over the experts a batch hits (shapes that
# depend on the routing) and has no static-shape counterpart here (moe/experts.py).
_EXPERTS = re.compile(r"Experts(?![a-z])")
# Linear-attention layers of hybrid decoders (Mamba mixers, gated delta-nets, other linear
# attentions): their recurrences are not checked for parity yet, but for the gated delta-nets of
# Qwen3-Next and Qwen3.5 (dense and MoE), which tests/e2e/test_families.py trains against eager.
_LINEAR_ATTENTION = re.compile(r"(Mamba\d*Mixer|BambaMixer|H1Mixer|LinearAttention|GatedDeltaNet|Rglru)(?![a-z])")
CHECKED_LINEAR_ATTENTION = {"Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"}


def refuse_unsupported(model: nn.Module) -> None:
    for path, module in model.named_modules():
        name = type(module).__name__
        if _EXPERTS.search(name) and not is_hf_experts(module) and not _inside_hf_experts(model, path):
            raise CaptureError(
                f"'{path}' ({name}) is a mixture-of-experts layer whose experts are not transformers' fused "
                "3D expert weights: megacompile captures experts as one grouped matmul over fused weights "
                "(gate_up_proj, down_proj) and cannot capture this layout yet (docs/families.md lists the "
                "families it trains)")
        if _LINEAR_ATTENTION.search(name) and name not in CHECKED_LINEAR_ATTENTION:
            raise CaptureError(
                f"'{path}' ({name}) is a linear-attention layer of a hybrid decoder, which megacompile cannot "
                "capture yet: its recurrence is not checked against eager training. Decoders of softmax "
                "attention, and the gated delta-nets of Qwen3-Next and Qwen3.5, train (docs/families.md lists them)")


def _inside_hf_experts(model: nn.Module, path: str) -> bool:
    parts = path.split(".")
    return any(is_hf_experts(model.get_submodule(".".join(parts[:i]))) for i in range(1, len(parts)))
