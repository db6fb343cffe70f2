"""A Hugging Face experts module's forward with static shapes: sort, grouped matmul, un-sort, combine.

transformers 5 keeps a layer's experts as fused 3D weights (`gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I], or transposed: [E, H, 2I] and [E, I, H]) in a module decorated with
`use_experts_implementation`, which picks the forward from `config._experts_implementation`. Its
"eager" forward loops over the experts a batch hits (shapes that depend on the routing), its
"grouped_mm" forward calls torch._grouped_mm (bf16 only, refused in float32 under fake tensors)
and its "batched_mm" forward gathers one weight matrix per routed token (S x the expert's bytes).
This forward computes what all three compute, for any token count, with shapes fixed by the
token count alone:

    S = T * top_k routed (token, expert) pairs
    ids [S] -> sort -> perm [S], offs [E] (where each expert's rows end)
    x[perm // top_k] [S, H] -> grouped_mm (gate_up) -> gate -> grouped_mm (down) [S, H]
    * routing weight -> back to (token, slot) order -> sum over the top_k slots [T, H]

The decorator's flags say the layout: `is_transposed` (weights [E, in, out]), `has_bias`
(per-expert biases), `has_gate` (gate_up_proj and `_apply_gate`, else up_proj and `act_fn`),
`has_post_expert_norm`. `weights` stands in for some of the module's own (by name, the same
shapes): the experts' weights with LoRA adapters added (capture/experts.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .grouped_mm import grouped_mm

# Attributes `use_experts_implementation` sets on every experts module it decorates, in every
# transformers 5 release; `has_post_expert_norm` and `_is_expert_parallel` came later (5.17 has
# neither) and read as False where a module has none.
_FLAGS = ("has_gate", "has_bias", "is_transposed")


def is_hf_experts(module: nn.Module) -> bool:
    """A transformers experts module with fused 3D weights whose forward this module replaces."""
    return all(hasattr(module, f) for f in _FLAGS) and hasattr(module, "num_experts") and hasattr(module, "down_proj")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, offs: torch.Tensor,
            ids: torch.Tensor, transposed: bool) -> torch.Tensor:
    # weight [E, out, in] (or [E, in, out] when transposed); bias [E, out]
    y = grouped_mm(x, weight if transposed else weight.transpose(-2, -1), offs)
    return y if bias is None else y + bias[ids]


def static_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, weights: dict[str, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k] (expert ids), top_k_weights [T, k] -> [T, H]."""
    weights = weights or {}

    def weight(name: str) -> torch.Tensor:
        return weights[name] if name in weights else getattr(self, name)
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    ids, perm = torch.sort(top_k_index.reshape(-1))                       # [S]: pairs grouped by expert
    experts = torch.arange(self.num_experts, device=ids.device, dtype=ids.dtype)
    offs = torch.searchsorted(ids, experts, right=True, out_int32=True)   # [E]: end of each expert's rows
    x = hidden_states[perm // top_k]                                       # [S, H]
    if self.has_gate:
        h = _linear(x, weight("gate_up_proj"), self.gate_up_proj_bias if self.has_bias else None, offs, ids,
                    self.is_transposed)
        h = self._apply_gate(h)                                            # [S, I]
    else:
        h = self.act_fn(_linear(x, weight("up_proj"), self.up_proj_bias if self.has_bias else None, offs, ids,
                                self.is_transposed))
    y = _linear(h, weight("down_proj"), self.down_proj_bias if self.has_bias else None, offs, ids, self.is_transposed)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1)                  # [S, H], float32 with fp32 routing
    y = torch.zeros_like(y).index_copy(0, perm, y)                         # back to (token, slot) order
    return y.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
