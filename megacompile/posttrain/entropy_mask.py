"""GRPO's `top_entropy_quantile` (Wang et al., 2025, "Beyond the 80/20 rule"): the policy term of
the loss counts only the completion tokens whose predictive entropy is in the top quantile of the
batch's, as TRL selects them: a token counts when its entropy is >= the (1 - q) quantile of the
entropies of every counted token (linear interpolation between order statistics, as
torch.quantile). q = 1 keeps every token; q = 0 keeps the highest.

Computed with static shapes (a sort and a gather, no boolean indexing), so the step that holds it
is captured and planned once whatever the mask."""
from __future__ import annotations

import torch


def token_entropies(logits: torch.Tensor, gradient: bool = False) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropies of the softmax, in fp32: without a gradient for the mask
    they choose (not differentiated, as in TRL), with one for the entropy bonus (entropy_coef)."""
    logits = (logits if gradient else logits.detach()).to(torch.promote_types(logits.dtype, torch.float32))
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.exp(logits - logz)
    return (logz.squeeze(-1) - (p * logits).sum(-1))


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """The q quantile of values[mask] (torch.quantile's linear interpolation), as a 0-d tensor; +inf
    when no value counts (then no token is kept)."""
    flat = values.reshape(-1).to(torch.promote_types(values.dtype, torch.float32))
    keep = mask.reshape(-1).bool()
    ordered, _ = torch.sort(torch.where(keep, flat, torch.full_like(flat, float("inf"))))
    count = keep.sum()
    position = q * (count - 1).clamp(min=0).to(flat.dtype)
    low = position.floor().long()
    high = position.ceil().long()
    # gathers, not indexing by a 0-d tensor: no value is read back in Python (the step is traced)
    below, above = ordered.gather(0, low.view(1)).squeeze(0), ordered.gather(0, high.view(1)).squeeze(0)
    # torch.lerp's weights: the fraction past the lower order statistic
    value = below + (above - below) * (position - low.to(flat.dtype))
    return torch.where(count > 0, value, torch.full_like(value, float("inf")))


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T) bool: the counted tokens whose entropy is >= the (1 - quantile) quantile of the counted
    tokens' entropies."""
    threshold = masked_quantile(entropies, mask, 1.0 - quantile)
    return (entropies * mask >= threshold) & mask.bool()
