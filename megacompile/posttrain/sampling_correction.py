"""The sampler's correction (TRL's `vllm_importance_sampling_correction`): completions sampled by
vLLM come from its bf16 kernels, not from the policy the engine trains, and the two assign a
token slightly different probabilities. Each completion token's loss term is weighed by the ratio
of the trained policy's probability (the old policy's log-probabilities, from the forward pass
after the rollout) to the sampler's, as TRL does:

    token_truncate      min(exp(old - sampled), cap) per token                 (TIS)
    token_mask          exp(old - sampled) per token, 0 where it exceeds cap
    sequence_truncate   min(exp(sum of old - sampled over the completion), cap), one per completion
    sequence_mask       the same ratio, 0 where it exceeds cap                  (TRL's default)

The weight is a constant of the step (no gradient flows through it): it multiplies the clipped
policy term after the entropy mask and before the KL term (posttrain/grpo.py)."""
from __future__ import annotations

import math

import torch

from ..errors import ArgumentError

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DEFAULT_MODE, DEFAULT_CAP = "sequence_mask", 3.0        # TRL's defaults
METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max")


def check(mode: str, cap) -> None:
    if mode not in MODES:
        raise ArgumentError(f"vllm_importance_sampling_mode must be one of {', '.join(MODES)}; got {mode!r}")
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ArgumentError(f"vllm_importance_sampling_cap must be a positive number (TRL's default 3.0); got {cap!r}")


def sampled_logps(completions: list, width: int) -> torch.Tensor | None:
    """(N, width) the sampler's log-probability of each completion token at its label position in
    rollout_batch's rows (0 elsewhere; NaN where it gave none: None), or None if a completion carries
    none (a sampler that does not report them)."""
    if not completions or any(c.logprobs is None for c in completions):
        return None
    out = torch.zeros(len(completions), width)
    for r, c in enumerate(completions):
        kept = max(0, min(len(c.tokens), width + 1 - len(c.prompt)))
        start = len(c.prompt) - 1
        out[r, start:start + kept] = torch.tensor([math.nan if x is None else x for x in c.logprobs[:kept]],
                                                  dtype=torch.float32)
    return out


def sampling_ratio(old_logps: torch.Tensor, sampled_logps: torch.Tensor, mask: torch.Tensor,
                   mode: str = DEFAULT_MODE, cap: float = DEFAULT_CAP) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, T) weights of the completion tokens (`mask`; `sampled_logps` NaN where the sampler gave
    none) and the metrics TRL logs: the mean and largest |old - sampled| over the tokens, and the
    smallest, mean and largest ratio (over the tokens, or over the completions in the sequence
    modes)."""
    check(mode, cap)
    mask = mask.to(torch.bool)
    scored = mask & ~torch.isnan(sampled_logps)     # a token the sampler gave no log-probability weighs 1
    diff = torch.where(scored, old_logps.double() - sampled_logps.double(), 0.0)
    sequence = mode.startswith("sequence")
    if sequence:
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    ratio = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
    gap = (old_logps.double() - sampled_logps.double()).abs()[scored]
    seen = ratio.flatten() if sequence else ratio[mask]
    metrics = dict(zip(METRICS, (gap.mean().item() if gap.numel() else 0.0, gap.max().item() if gap.numel() else 0.0,
                                 seen.min().item() if seen.numel() else 0.0, seen.mean().item() if seen.numel() else 0.0,
                                 seen.max().item() if seen.numel() else 0.0)))
    return ratio.expand_as(old_logps).to(old_logps.dtype).contiguous(), metrics
