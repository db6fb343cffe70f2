"""What stage grpo logs of a rollout batch's completions, as TRL's GRPOTrainer logs them."""
from __future__ import annotations

import torch

COMPLETION_METRICS = ("completions/mean_length", "completions/min_length", "completions/max_length",
                      "completions/clipped_ratio", "completions/mean_terminated_length",
                      "completions/min_terminated_length", "completions/max_terminated_length", "frac_reward_zero_std")


def completion_metrics(lengths: torch.Tensor, truncated: torch.Tensor, spread: torch.Tensor) -> dict:
    """What TRL logs of a rollout batch's completions: their lengths, the share cut at
    max_completion_length (clipped_ratio) and the lengths of the others (0 where none ended), and
    the share of completions whose rewards' spread is 0 (frac_reward_zero_std: no advantage to learn).
    `spread` (N,): the standard deviation each completion's advantage is scaled by, as TRL takes it
    (its group's; the batch's under scale_rewards batch and under GDPO, of the summed normalised
    rewards)."""
    ended = lengths[~truncated]
    return {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
            "completions/mean_terminated_length": ended.mean().item() if len(ended) else 0.0,
            "completions/min_terminated_length": ended.min().item() if len(ended) else 0.0,
            "completions/max_terminated_length": ended.max().item() if len(ended) else 0.0,
            "frac_reward_zero_std": torch.isclose(spread, torch.zeros_like(spread)).float().mean().item()}
