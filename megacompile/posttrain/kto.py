"""Kahneman-Tversky optimisation (Ethayarajh et al., 2024; TRL's KTOTrainer, LlamaFactory's stage
kto): preference learning from completions each marked desirable or undesirable, no pairs needed.

With r = log pi(y|x) - log pi_ref(y|x) (sequence log-probabilities, summed over the completion),
b = beta, sigma the logistic function and z the batch's KL estimate,

    kto                 desirable: 1 - sigma(b (r - z))     undesirable: 1 - sigma(b (z - r))
    apo_zero_unpaired   desirable: 1 - sigma(b r)           undesirable: sigma(b r)          (no z)

each weighted by desirable_weight or undesirable_weight, and the batch's loss is their mean over
its completions (plus LlamaFactory's pref_ftx term where asked: `KTOLoss.batch`). z is TRL's: each prompt of the batch paired with another example's completion
(x, y'), z = max(0, mean(log pi(y'|x) - log pi_ref(y'|x))), held constant (a forward pass
without gradient); it arrives as a step input, as the reference's log-probabilities do."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..capture import LossAndOutputs
from ..errors import ArgumentError
from .dpo import logits_of
from .logprobs import sequence_logprobs, token_logprobs

__all__ = ["KTOLoss", "KTOObjective", "LOSS_TYPES", "kl_estimate", "kto_loss"]

LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_loss(policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float,
             beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             loss_type: str = "kto") -> torch.Tensor:
    """(B,) losses from (B,) sequence log-probabilities under the policy and the reference,
    `desirable` (B,) (true, or 1.0, for a desirable completion) and the KL estimate `kl`."""
    ratio = policy - ref
    if loss_type == "kto":
        wanted, unwanted = 1 - torch.sigmoid(beta * (ratio - kl)), 1 - torch.sigmoid(beta * (kl - ratio))
    elif loss_type == "apo_zero_unpaired":
        wanted, unwanted = 1 - torch.sigmoid(beta * ratio), torch.sigmoid(beta * ratio)
    else:
        raise ArgumentError(f"KTO loss_type must be one of {', '.join(LOSS_TYPES)}; got {loss_type!r}")
    return torch.where(desirable.bool(), desirable_weight * wanted, undesirable_weight * unwanted)


def kl_estimate(policy_kl: torch.Tensor, ref_kl: torch.Tensor) -> torch.Tensor:
    """z from the mismatched rows' sequence log-probabilities: their mean log-ratio, at least 0."""
    return (policy_kl - ref_kl).mean().clamp(min=0).detach()


@dataclass(frozen=True)
class KTOLoss:
    """The KTO objective of a batch: (B, T, V) logits, (B, T) labels (IGNORE on the prompt and the
    padding), (B,) reference log-probabilities, (B,) desirable (1.0 or 0.0) and the KL estimate
    (a 0-dim tensor) -> the mean loss over the B completions."""
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    loss_type: str = "kto"
    ftx: float = 0.0

    def __post_init__(self) -> None:
        for key in ("beta", "desirable_weight", "undesirable_weight"):
            value = getattr(self, key)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
                raise ArgumentError(f"KTO {key} must be a positive number; got {value!r}")
        if self.loss_type not in LOSS_TYPES:
            raise ArgumentError(f"KTO loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if isinstance(self.ftx, bool) or not (isinstance(self.ftx, (int, float)) and self.ftx >= 0):
            raise ArgumentError(f"KTO pref_ftx (the weight of the desirable completions' NLL) must be a number >= 0; "
                                f"got {self.ftx!r}")

    @property
    def needs_kl(self) -> bool:
        return self.loss_type == "kto"

    def examples(self, policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor,
                 kl: torch.Tensor | float) -> torch.Tensor:
        return kto_loss(policy, ref, desirable, kl, self.beta, self.desirable_weight, self.undesirable_weight,
                        self.loss_type)

    def batch(self, policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float,
              tokens: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss from its (B,) sequence log-probabilities and completion lengths: the
        examples' mean, plus, with `ftx` (LlamaFactory's pref_ftx), ftx x the desirable completions'
        mean NLL per token rescaled by B / (their count), as LlamaFactory's KTO trainer adds it (none
        where no completion of the micro-batch is desirable)."""
        loss = self.examples(policy, ref, desirable, kl).mean()
        if not self.ftx:
            return loss
        wanted = desirable.bool()
        count = wanted.sum().clamp(min=1).to(policy.dtype)
        nll = torch.where(wanted, -policy / tokens.clamp(min=1), torch.zeros_like(policy)).sum()
        return loss + self.ftx * nll / count / count * policy.shape[0]

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
                 kl: torch.Tensor) -> torch.Tensor:
        return self.with_sequences(logits, labels, ref_logps, desirable, kl)[0]

    def with_sequences(self, logits: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor,
                       desirable: torch.Tensor, kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the (B,) rows' log-probabilities it read."""
        logps, mask = token_logprobs(logits, labels)
        rows = logps.sum(-1)
        return self.batch(rows, ref_logps, desirable, kl, mask.sum(-1).to(logps.dtype)), rows


class KTOObjective(nn.Module):
    """The policy with the KTO loss on top, as one module for compile(): forward(input_ids, labels,
    ref_logps, desirable, kl) -> the loss; forward(input_ids, labels) -> each row's log
    p(completion | prompt), (B,): the forward-only pass that gives the reference's log-probabilities
    before training moves it, and the policy's on the mismatched rows of the KL estimate. With
    `hand_out`, the loss comes as LossAndOutputs(loss, {"logps": the (B,) rows' log-probabilities the
    loss read}), for the logged rewards."""

    def __init__(self, policy: nn.Module, loss: KTOLoss = KTOLoss(), hand_out: bool = False):
        super().__init__()
        self.policy, self.loss, self.hand_out = policy, loss, hand_out

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor | None = None,
                desirable: torch.Tensor | None = None, kl: torch.Tensor | None = None, **media) -> torch.Tensor:
        """The loss; without ref_logps, each row's log p(completion | prompt). `media`: a
        vision-language policy's image inputs, handed to it as they are."""
        logits = logits_of(self.policy(input_ids, **media))
        if ref_logps is None:
            return sequence_logprobs(logits, labels)
        if not self.hand_out:
            return self.loss(logits, labels, ref_logps, desirable, kl)
        loss, rows = self.loss.with_sequences(logits, labels, ref_logps, desirable, kl)
        return LossAndOutputs(loss, {"logps": rows})
