"""Group-relative advantages of GRPO, nan-aware as TRL computes them.

A reward of NaN is a completion no reward function scored: it is left out of its group's mean and
standard deviation, and its own advantage is 0 (it moves nothing). A group with no scored
completion, or a standard deviation from fewer than two, gives its completions 0 as well.

    scale_rewards   group (TRL's default, and its `true`): divided by the group's standard deviation
                    batch: by the whole batch's (PPO Lite); none (its `false`): not divided (Dr. GRPO)
"""
from __future__ import annotations

import math

import torch

from ..errors import ArgumentError

SCALES = ("group", "batch", "none")
EPS = 1e-4


def scale_of(value) -> str:
    """TRL's scale_rewards: one of SCALES, or its booleans (true: group, false: none)."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    if value not in SCALES:
        raise ArgumentError(f"scale_rewards must be one of {', '.join(SCALES)} (or true: group, false: none); "
                            f"got {value!r}")
    return value


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation of the values that are not NaN; NaN where fewer than two are."""
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True) if dim is not None else (~torch.isnan(x)).sum()
    squares = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) if dim is not None else torch.nansum((x - mean) ** 2)
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.full_like(squares, float("nan")))
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str | bool = "group",
                     eps: float = EPS) -> torch.Tensor:
    """(N,) rewards of N / group_size groups of consecutive completions (NaN: not scored) -> (N,)
    advantages: the reward less its group's mean, divided by the standard deviation `scale` names
    + eps; 0 where the reward, or the statistics, are NaN."""
    scale = scale_of(scale)
    if group_size < 1 or rewards.numel() % group_size:
        raise ArgumentError(f"GRPO: {rewards.numel()} rewards do not split into groups of num_generations="
                            f"{group_size}; give every prompt the same number of completions")
    grouped = rewards.float().view(-1, group_size)                     # (groups, group_size)
    advantages = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        advantages = advantages / (nanstd(grouped.reshape(-1)) + eps)
    return torch.nan_to_num(advantages.reshape(-1), nan=0.0)


def decoupled_rewards(per_function: torch.Tensor, weights, group_size: int, eps: float = EPS) -> torch.Tensor:
    """GDPO's rewards (TRL's multi_objective_aggregation normalize_then_sum): (N, K) rewards of K
    functions (NaN: not scored) -> (N,): each function's rewards normalised within their group (less
    the group's mean, over its standard deviation + eps), then summed with the weights (a nansum);
    NaN where no function scored the completion."""
    n, k = per_function.shape
    if group_size < 1 or n % group_size:
        raise ArgumentError(f"GRPO: {n} rewards do not split into groups of num_generations={group_size}")
    weights = torch.ones(k) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    grouped = per_function.float().view(-1, group_size, k)
    normalised = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + eps)
    summed = torch.nansum(normalised.reshape(n, k) * weights, dim=1)
    summed[torch.isnan(per_function).all(dim=1)] = math.nan
    return summed


def decoupled_advantages(per_function: torch.Tensor, weights, group_size: int, eps: float = EPS) -> torch.Tensor:
    """(N,) GDPO's advantages: decoupled_rewards normalised over the whole batch; 0 where no function
    scored the completion, or where the statistics are NaN."""
    summed = decoupled_rewards(per_function, weights, group_size, eps)
    return torch.nan_to_num((summed - torch.nanmean(summed)) / (nanstd(summed) + eps), nan=0.0)
