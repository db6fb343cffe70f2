"""Group relative policy optimisation (Shao et al., 2024) with the loss normalisations in use since:
Dr. GRPO (Liu et al., 2025) and DAPO (Yu et al., 2025), named as TRL names them.

A batch holds `num_generations` completions of each prompt, consecutive. Each completion's reward
becomes an advantage relative to its group; every completion token then carries the clipped
importance-weighted advantage (PPO's surrogate), and optionally a KL penalty to a reference
policy (the k3 estimator, beta 0 by default)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ArgumentError
from .dpo import logits_of
from .logprobs import token_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """(N,) rewards of N / group_size groups of consecutive completions -> (N,) advantages: the reward
    less its group's mean, divided by the group's (unbiased) standard deviation + eps when scale."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ArgumentError(f"GRPO: {rewards.numel()} rewards do not split into groups of num_generations="
                            f"{group_size}; give every prompt the same number of completions")
    grouped = rewards.float().view(-1, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        std = grouped.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(grouped[:, :1])
        advantages = advantages / (std + eps)
    return advantages.view(-1)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              ref_logps: torch.Tensor | None = None, epsilon: float = 0.2, epsilon_high: float | None = None,
              beta: float = 0.0, loss_type: str = "dapo",
              max_completion_length: int | None = None) -> tuple[torch.Tensor, dict]:
    """The loss of (N, T) per-token log-probabilities of the completions under the policy being
    trained, those under the policy that sampled them (old_logps), (N,) advantages and the (N, T)
    mask of completion tokens; and metrics (clip fractions, mean KL) as detached tensors.

    Normalisation (loss_type): grpo, each sequence's mean then the mean over sequences; bnpo and
    dapo, the sum over every token divided by the number of tokens; dr_grpo, the sum divided by
    N * max_completion_length (a constant)."""
    if loss_type not in LOSS_TYPES:
        raise ArgumentError(f"GRPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
    a = advantages.unsqueeze(1).to(logps.dtype)
    per_token = -torch.min(ratio * a, clipped * a)
    metrics = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ArgumentError("GRPO with beta != 0 needs the reference policy's log-probabilities (ref_logps)")
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else mask.shape[1]
        loss = (per_token * mask).sum() / (mask.shape[0] * length)
    else:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    tokens = mask.sum().clamp(min=1)
    low_clip = (ratio < 1 - epsilon) & (a < 0)
    high_clip = (ratio > 1 + high) & (a > 0)
    metrics["clip_ratio_low"] = ((low_clip * mask).sum() / tokens).detach()
    metrics["clip_ratio_high"] = ((high_clip * mask).sum() / tokens).detach()
    metrics["clip_ratio"] = (((low_clip | high_clip) * mask).sum() / tokens).detach()
    return loss, metrics


@dataclass(frozen=True)
class GRPOLoss:
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_type: str = "dapo"
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        if not (0 < self.epsilon < 1):
            raise ArgumentError(f"GRPO epsilon must be in (0, 1), e.g. 0.2; got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ArgumentError(f"GRPO epsilon_high must be positive (DAPO uses 0.28); got {self.epsilon_high!r}")
        if self.beta < 0:
            raise ArgumentError(f"GRPO beta must be >= 0 (0 turns the KL term off); got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ArgumentError(f"GRPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                 ref_logps: torch.Tensor | None = None) -> torch.Tensor:
        logps, mask = token_logprobs(logits, labels)
        loss, _ = grpo_loss(logps, old_logps, advantages, mask, ref_logps, self.epsilon, self.epsilon_high,
                            self.beta, self.loss_type, self.max_completion_length)
        return loss


class GRPOObjective(nn.Module):
    """The policy with the GRPO loss on top, for compile(). One module, three uses, told apart by
    the inputs given (each set of inputs is captured and planned once):

    - forward(input_ids, labels, old_logps, advantages[, ref_logps]) -> the loss (a training step);
      labels IGNORE outside the completions;
    - forward(input_ids, labels) -> (N, T) per-token log-probabilities (forward only: the old
      policy's or the reference's);
    - forward(input_ids, last=positions) -> (N, V) logits at each row's last position (forward
      only: sampling a next token at a fixed row length, so generation plans once)."""

    def __init__(self, policy: nn.Module, loss: GRPOLoss = GRPOLoss()):
        super().__init__()
        self.policy, self.loss = policy, loss

    def forward(self, input_ids, labels=None, old_logps=None, advantages=None, ref_logps=None, last=None):
        logits = logits_of(self.policy(input_ids))
        if last is not None:
            return logits.gather(1, last.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1).float()
        if advantages is None:
            return token_logprobs(logits, labels)[0]
        return self.loss(logits, labels, old_logps, advantages, ref_logps)
