"""The sampler's correction (TRL's `vllm_importance_sampling_correction`): completions sampled by
vLLM come from its bf16 kernels, not from the policy the engine trains, and the two assign a
token slightly different probabilities. Each completion token's loss term is weighed by the ratio
of the trained policy's probability (the old policy's log-probabilities, from the forward pass
after the rollout) to the sampler's, as TRL does:

    token_truncate      exp(old - sampled) per token, clamped into [clip_min, clip_max]   (TIS)
    token_mask          exp(old - sampled) per token, 0 outside [clip_min, clip_max]
    sequence_truncate   exp(sum of old - sampled over the completion), one per completion, clamped
    sequence_mask       the same ratio, 0 outside the bounds                    (TRL's default)

clip_max is 3.0 by default (TRL's vllm_importance_sampling_clip_max, formerly _cap), clip_min none;
either may be None (no bound on that side), not both in a truncate mode.

The weight is a constant of the step (no gradient flows through it): it multiplies the clipped
policy term after the entropy mask and before the KL term (posttrain/grpo.py)."""
from __future__ import annotations

import math

import torch

from ..errors import ArgumentError

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DEFAULT_MODE, DEFAULT_CLIP_MAX = "sequence_mask", 3.0        # TRL's defaults
METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max")


def check(mode: str, clip_max, clip_min=None) -> None:
    if mode not in MODES:
        raise ArgumentError(f"vllm_importance_sampling_mode must be one of {', '.join(MODES)}; got {mode!r}")
    for key, bound in (("clip_max", clip_max), ("clip_min", clip_min)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not 0 <= bound < math.inf or (key == "clip_max" and bound == 0)):
            raise ArgumentError(f"vllm_importance_sampling_{key} must be a {'positive' if key == 'clip_max' else '>= 0'} "
                                f"number (TRL's default {DEFAULT_CLIP_MAX if key == 'clip_max' else 'none'}), or null "
                                f"for no bound; got {bound!r}")
    if clip_max is None and clip_min is None and mode.endswith("truncate"):
        raise ArgumentError(f"vllm_importance_sampling_mode {mode} clamps the ratio into [clip_min, clip_max], and "
                            "both are null: give vllm_importance_sampling_clip_max (3.0 by default) or _clip_min")
    if clip_max is not None and clip_min is not None and not clip_min < clip_max:
        raise ArgumentError(f"vllm_importance_sampling_clip_min ({clip_min}) must be below vllm_importance_sampling_"
                            f"clip_max ({clip_max})")


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
                   mode: str = DEFAULT_MODE, clip_max: float | None = DEFAULT_CLIP_MAX,
                   clip_min: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """(N, T) weights of the completion tokens (`mask`; `sampled_logps` NaN where the sampler gave
    none) and the metrics TRL logs: the mean and largest |old - sampled| over the tokens, and the
    smallest, mean and largest ratio (over the tokens, or over the completions in the sequence
    modes)."""
    check(mode, clip_max, clip_min)
    mask = mask.to(torch.bool)
    scored = mask & ~torch.isnan(sampled_logps)     # a token the sampler gave no log-probability weighs 1
    diff = torch.where(scored, old_logps.double() - sampled_logps.double(), 0.0)
    sequence = mode.startswith("sequence")
    if sequence:
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        outside = (ratio > (math.inf if clip_max is None else clip_max)) | (ratio < (clip_min or 0.0))
        ratio = ratio.masked_fill(outside, 0.0)
    gap = (old_logps.double() - sampled_logps.double()).abs()[scored]
    seen = ratio.flatten() if sequence else ratio[mask]
    metrics = dict(zip(METRICS, (gap.mean().item() if gap.numel() else 0.0, gap.max().item() if gap.numel() else 0.0,
                                 seen.min().item() if seen.numel() else 0.0, seen.mean().item() if seen.numel() else 0.0,
                                 seen.max().item() if seen.numel() else 0.0)))
    return ratio.expand_as(old_logps).to(old_logps.dtype).contiguous(), metrics
