"""Group relative policy optimisation (Shao et al., 2024) with the loss normalisations in use since:
Dr. GRPO (Liu et al., 2025) and DAPO (Yu et al., 2025), the policy terms of CISPO (MiniMax-M1), SAPO,
LUSPO and VESPO, named as TRL names them, and TRL's options:
sequence-level importance sampling (GSPO, Zheng et al., 2025), two-sided clipping (`delta`,
INTELLECT-2) and the high-entropy token mask (`top_entropy_quantile`, entropy_mask.py).

A batch holds `num_generations` completions of each prompt, consecutive. Each completion's reward
becomes an advantage relative to its group (advantages.py); every completion token then carries the
clipped importance-weighted advantage (PPO's surrogate), and optionally a KL penalty to a reference
policy (the k3 estimator, beta 0 by default). The log-probabilities are those of the logits divided
by the sampling temperature, as TRL computes them for the loss, the old policy and the reference."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ArgumentError
from .advantages import group_advantages
from .dpo import logits_of
from .entropy_mask import high_entropy_mask, token_entropies
from .logprobs import token_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")      # PPO's clipped surrogate; their clip fraction
LEVELS = ("token", "sequence")

__all__ = ["GRPOLoss", "GRPOObjective", "LEVELS", "LOSS_TYPES", "group_advantages", "grpo_loss"]


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              ref_logps: torch.Tensor | None = None, epsilon: float = 0.2, epsilon_high: float | None = None,
              beta: float = 0.0, loss_type: str = "dapo", max_completion_length: int | None = None,
              importance_sampling_level: str = "token", delta: float | None = None,
              entropy_mask: torch.Tensor | None = None, sampling_ratio: torch.Tensor | None = None,
              token_count: torch.Tensor | None = None, bias_correction_kl: bool = False,
              sapo_temperatures: tuple[float, float] = (1.0, 1.05),
              vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
              off_policy_threshold: float | None = None,
              sampling_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The loss of (N, T) per-token log-probabilities of the completions under the policy being
    trained, those under the policy that sampled them (old_logps), (N,) advantages and the (N, T)
    mask of completion tokens; and metrics (clip fractions, mean KL) as detached tensors.

    Importance weights: `token`, exp(logp - old) per token; `sequence`, exp of the mean of
    logp - old over each completion's tokens, one weight per completion (GSPO). `delta` caps the
    unclipped weight from above (two-sided clipping). `entropy_mask` (N, T): the tokens whose
    policy term counts (the KL term counts on every token). `sampling_ratio` (N, T): the sampler's
    correction (sampling_correction.py), a weight of the policy term.

    Policy term (loss_type): PPO's clipped surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),
    except cispo, -sg(min(r, epsilon_high)) A logp (the weight clipped, its gradient stopped, as TRL
    clips it: epsilon_high itself is the cap, 5.0 in the ScaleRL paper), and sapo, a soft gate
    -sigmoid(tau (r - 1)) 4 / tau A, tau the first of `sapo_temperatures` where A > 0, else the second,
    and vespo, -sg(phi(w)) A logp with w the completion's whole importance ratio (exp of the summed
    log-ratios, times the sampler's correction, token by token) and phi(w) = e^lam w^k e^(-lam w),
    `vespo` = (k, lam) where A >= 0 then (k, lam) where A < 0 (TRL's vespo_k_pos, _lambda_pos,
    _k_neg, _lambda_neg); the sampler's correction is then inside phi, not a factor of the term.

    `off_policy_threshold` (TRL's off_policy_mask_threshold, DeepSeek-V3.2's off-policy sequence
    mask): a completion of negative advantage whose mean over its tokens of sampler's log-probability
    less the policy's (a constant) exceeds it leaves the policy term; the sampler's are
    `sampling_logps` (vLLM's, NaN where it gave none: 0 there) or else old_logps.

    Normalisation: grpo and sapo, each sequence's mean then the mean over sequences; bnpo, dapo,
    cispo and vespo, the sum over every token divided by the number of tokens; dr_grpo, the sum divided by
    N * max_completion_length (a constant); luspo, each sequence's sum, then the mean over sequences
    (GSPO's weight, with importance_sampling_level sequence, scaled by the completion's length).
    `token_count` (dapo, cispo, vespo): the count to divide by instead of this batch's, when the batch is
    one micro-batch of a larger generation batch (TRL divides by the generation batch's completion
    tokens x gradient_accumulation_steps / steps_per_generation: one accumulation window's share).
    `bias_correction_kl` (TRL's use_bias_correction_kl): the KL term, and its logged mean, times the
    unclipped importance weight, which makes its gradient the unbiased reverse-KL gradient
    (DeepSeek-V3.2); the weight is differentiable, so it changes the gradient on-policy too."""
    if loss_type not in LOSS_TYPES:
        raise ArgumentError(f"GRPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    if importance_sampling_level not in LEVELS:
        raise ArgumentError(f"GRPO importance_sampling_level must be one of {', '.join(LEVELS)}; got "
                            f"{importance_sampling_level!r}")
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":         # (N, 1): one weight per completion
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)
    a = advantages.unsqueeze(1).to(logps.dtype)
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=high).detach() * a * logps
    elif loss_type == "sapo":
        tau = torch.where(a > 0, sapo_temperatures[0], sapo_temperatures[1])
        per_token = (-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a).expand_as(logps)
    elif loss_type == "vespo":
        phi = _gamma_weights(logps - old_logps, mask, a, sampling_ratio, vespo)
        per_token = -phi * a * logps
    else:
        clipped = torch.clamp(ratio, 1 - epsilon, 1 + high)
        capped = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token = -torch.min(capped * a, clipped * a).expand_as(logps)
    if off_policy_threshold is not None:
        sampler = old_logps if sampling_logps is None else sampling_logps
        drift = torch.nan_to_num(sampler - logps.detach(), nan=0.0) * mask
        drift = drift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        per_token = per_token * ((a >= 0) | (drift <= off_policy_threshold)).to(logps.dtype)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(logps.dtype)
    if sampling_ratio is not None and loss_type != "vespo":
        per_token = per_token * sampling_ratio.to(logps.dtype)
    metrics = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ArgumentError("GRPO with beta != 0 needs the reference policy's log-probabilities (ref_logps)")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).detach()
    if loss_type in ("grpo", "sapo"):
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        length = max_completion_length if max_completion_length is not None else mask.shape[1]
        loss = (per_token * mask).sum() / (mask.shape[0] * length)
    elif loss_type == "luspo":
        loss = (per_token * mask).sum(-1).mean()
    elif loss_type in ("dapo", "cispo", "vespo") and token_count is not None:
        loss = (per_token * mask).sum() / token_count.to(logps.dtype).clamp(min=1)
    else:
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    tokens = mask.sum().clamp(min=1)
    if loss_type in CLIPPED:
        low_clip = ((ratio < 1 - epsilon) & (a < 0)).expand_as(logps)
        high_clip = ((ratio > 1 + high) & (a > 0)).expand_as(logps)
        metrics["clip_ratio_low"] = ((low_clip * mask).sum() / tokens).detach()
        metrics["clip_ratio_high"] = ((high_clip * mask).sum() / tokens).detach()
        metrics["clip_ratio"] = (((low_clip | high_clip) * mask).sum() / tokens).detach()
    elif loss_type == "cispo":
        capped = ((ratio > high) & (a > 0)).expand_as(logps)
        metrics["cispo_clip_ratio"] = ((capped * mask).sum() / tokens).detach()
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = ((phi * mask).sum() / tokens).detach()
    return loss, metrics


@torch.no_grad()
def _gamma_weights(log_ratio: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, sampling_ratio: torch.Tensor | None,
                   vespo: tuple[float, float, float, float]) -> torch.Tensor:
    """(N, 1) VESPO's phi(w), a constant of the step: log w clamped into [log 1e-8, 20] (each token's
    log-ratio into [-20, 20] first), as TRL computes it."""
    floor = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampling_ratio is not None:
        log_w = log_w + torch.log(sampling_ratio.to(log_w.dtype)).clamp(floor, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(floor, 20.0)
    k_pos, lam_pos, k_neg, lam_neg = vespo
    k = torch.where(a >= 0, k_pos, k_neg)
    lam = torch.where(a >= 0, lam_pos, lam_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class GRPOLoss:
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_type: str = "dapo"
    max_completion_length: int | None = None
    temperature: float = 1.0
    importance_sampling_level: str = "token"
    delta: float | None = None
    top_entropy_quantile: float = 1.0
    bias_correction_kl: bool = False
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)       # TRL's sapo_temperature_pos, _neg
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)     # vespo_k_pos, _lambda_pos, _k_neg, _lambda_neg
    # TRL's entropy bonus: the loss less entropy_coef x the mean entropy of the counted tokens (those
    # the entropy mask keeps), whatever the loss type's normalisation
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None

    def __post_init__(self) -> None:
        if not (0 < self.epsilon < 1):
            raise ArgumentError(f"GRPO epsilon must be in (0, 1), e.g. 0.2; got {self.epsilon!r}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ArgumentError(f"GRPO epsilon_high must be positive (DAPO uses 0.28); got {self.epsilon_high!r}")
        if self.beta < 0:
            raise ArgumentError(f"GRPO beta must be >= 0 (0 turns the KL term off); got {self.beta!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ArgumentError(f"GRPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if not self.temperature > 0:
            raise ArgumentError(f"GRPO temperature must be > 0: the training log-probabilities divide the logits by "
                                f"it; got {self.temperature!r}")
        if self.importance_sampling_level not in LEVELS:
            raise ArgumentError(f"GRPO importance_sampling_level must be one of {', '.join(LEVELS)}; got "
                                f"{self.importance_sampling_level!r}")
        if self.delta is not None and not self.delta > 0:
            raise ArgumentError(f"GRPO delta must be positive (above 1 + epsilon_high; INTELLECT-2 uses 4); got "
                                f"{self.delta!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ArgumentError(f"GRPO top_entropy_quantile must be in [0, 1] (1: every token); got "
                                f"{self.top_entropy_quantile!r}")
        if not all(t > 0 for t in self.sapo_temperatures):
            raise ArgumentError(f"GRPO sapo temperatures must be positive (TRL's 1.0 and 1.05); got "
                                f"{self.sapo_temperatures!r}")

    def logprobs(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities at the sampling temperature, and the mask of counted tokens."""
        return token_logprobs(logits if self.temperature == 1.0 else logits / self.temperature, labels)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                 ref_logps: torch.Tensor | None = None, sampling_ratio: torch.Tensor | None = None,
                 token_count: torch.Tensor | None = None, sampling_logps: torch.Tensor | None = None) -> torch.Tensor:
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logps, mask = token_logprobs(logits, labels)
        entropy = None
        if self.top_entropy_quantile < 1.0:
            entropy = high_entropy_mask(token_entropies(logits), mask, self.top_entropy_quantile)
        bonus = 0.0
        if self.entropy_coef:
            counted = mask if entropy is None else mask & entropy
            h = token_entropies(logits, gradient=True)
            bonus = self.entropy_coef * (h * counted).sum() / counted.sum().clamp(min=1)
        loss, _ = grpo_loss(logps, old_logps, advantages, mask, ref_logps, self.epsilon, self.epsilon_high,
                            self.beta, self.loss_type, self.max_completion_length, self.importance_sampling_level,
                            self.delta, entropy, sampling_ratio, token_count, self.bias_correction_kl,
                            self.sapo_temperatures, self.vespo, self.off_policy_mask_threshold, sampling_logps)
        return loss - bonus


class GRPOObjective(nn.Module):
    """The policy with the GRPO loss on top, for compile(). One module, three uses, told apart by
    the inputs given (each set of inputs is captured and planned once):

    - forward(input_ids, labels, old_logps, advantages[, ref_logps, sampling_ratio, token_count,
      sampling_logps]) ->
      the loss (a training step); labels IGNORE outside the completions;
    - forward(input_ids, labels) -> (N, T) per-token log-probabilities at the loss's temperature
      (forward only: the old policy's or the reference's);
    - forward(input_ids, last=positions) -> (N, V) logits at each row's last position (forward
      only: sampling a next token at a fixed row length, so generation plans once; the sampler
      divides them by its temperature).

    `media`: a vision-language policy's image inputs (pixel_values, image_grid_thw, ...) for the
    rows, handed to it as they are, in any of the three."""

    def __init__(self, policy: nn.Module, loss: GRPOLoss = GRPOLoss()):
        super().__init__()
        self.policy, self.loss = policy, loss

    def forward(self, input_ids, labels=None, old_logps=None, advantages=None, ref_logps=None, last=None,
                sampling_ratio=None, token_count=None, sampling_logps=None, **media):
        logits = logits_of(self.policy(input_ids, **media))
        if last is not None:
            return logits.gather(1, last.view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1).float()
        if advantages is None:
            return self.loss.logprobs(logits, labels)[0]
        return self.loss(logits, labels, old_logps, advantages, ref_logps, sampling_ratio, token_count, sampling_logps)
