"""Direct preference optimisation (Rafailov et al., 2023) and its IPO variant (Azar et al., 2023).

A step holds chosen and rejected completions packed in one batch: the first half of the rows are
the chosen ones, the second half the rejected ones, of the same prompts in the same order. The
reference model's log-probabilities are computed before the step (a forward-only pass of the
frozen reference, or read from a cache) and arrive as step inputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ArgumentError
from .logprobs import sequence_logprobs

LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta * (log pi - log pi_ref) of the chosen and the
    rejected completions, from sequence log-probabilities (B,) each.

    sigmoid: -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h), h the difference of the
    log-ratios (label smoothing as conservative DPO); ipo: (h - 1 / (2 beta))^2."""
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ArgumentError(f"DPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


@dataclass(frozen=True)
class DPOLoss:
    """The DPO objective of a packed batch: (2B, T, V) logits, (2B, T) labels (chosen rows first,
    IGNORE on the prompt and padding), (2B,) reference log-probabilities of the same rows -> the
    mean loss over the B pairs."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str = "sigmoid"

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ArgumentError(f"DPO beta must be a positive number, e.g. 0.1; got {self.beta!r}")
        if not (isinstance(self.label_smoothing, (int, float)) and 0.0 <= self.label_smoothing < 0.5):
            raise ArgumentError(f"DPO label_smoothing must be in [0, 0.5); got {self.label_smoothing!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ArgumentError(f"DPO loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        policy = sequence_logprobs(logits, labels)
        if policy.shape[0] % 2 or ref_logps.shape != policy.shape:
            raise ArgumentError(f"a DPO batch packs chosen rows then as many rejected rows, with one reference "
                                f"log-probability per row; got {policy.shape[0]} rows and ref_logps of shape "
                                f"{tuple(ref_logps.shape)}")
        half = policy.shape[0] // 2
        losses, _, _ = dpo_loss(policy[:half], policy[half:], ref_logps[:half], ref_logps[half:],
                                self.beta, self.label_smoothing, self.loss_type)
        return losses.mean()


class DPOObjective(nn.Module):
    """The policy with the DPO loss on top, as one module for compile(): its forward takes the packed
    batch and returns the loss, so the engine trains it like any model whose output is its loss.
    The policy's parameters keep their names under `policy.`."""

    def __init__(self, policy: nn.Module, loss: DPOLoss = DPOLoss()):
        super().__init__()
        self.policy, self.loss = policy, loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor | None = None) -> torch.Tensor:
        """The loss; without ref_logps, each row's log p(completion | prompt), (2B,): the
        forward-only pass that gives the reference's log-probabilities before training moves it."""
        logits = logits_of(self.policy(input_ids))
        if ref_logps is None:
            return sequence_logprobs(logits, labels)
        return self.loss(logits, labels, ref_logps)


def logits_of(output) -> torch.Tensor:
    """A causal LM's logits, whether it returns them or a Hugging Face output holding them."""
    return output if isinstance(output, torch.Tensor) else output.logits
