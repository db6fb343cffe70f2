"""Direct preference optimisation (Rafailov et al., 2023) and the other preference losses of TRL's
DPOTrainer (dpo_losses.py: IPO, hinge, robust, BCO, SPPO, NCA, AOT, APO, EXO, DiscoPOP, SFT, and
weighted sums of them), and the reference-free SimPO and ORPO of its CPO and ORPO trainers.

A step holds chosen and rejected completions packed in one batch: the first half of the rows are
the chosen ones, the second half the rejected ones, of the same prompts in the same order. The
reference model's log-probabilities are computed before the step (a forward-only pass of the
frozen reference, or read from a cache) and arrive as step inputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..capture import LossAndOutputs
from ..errors import ArgumentError
from .dpo_losses import LOSS_TYPES, READS_LABEL_SMOOTHING, REFERENCE_FREE, check_f_divergence, combined_loss, loss_types
from .logprobs import sequence_logprobs, token_logprobs

__all__ = ["DPOLoss", "DPOObjective", "LOSS_TYPES", "dpo_loss", "logits_of"]


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str | tuple = "sigmoid", *, loss_weights=None, chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None,
             discopop_tau: float = 0.05, simpo_gamma: float = 0.5,
             f_divergence: tuple[str, float] = ("reverse_kl", 0.5)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta * (log pi - log pi_ref) of the chosen and the
    rejected completions, from sequence log-probabilities (B,) each; chosen_tokens and
    rejected_tokens (B,): the completions' token counts (ipo, sigmoid_norm and sft read them).
    loss_type: one of dpo_losses.LOSS_TYPES or several, summed with loss_weights. f_divergence:
    (TRL's f_divergence_type, f_alpha_divergence_coef)."""
    losses = combined_loss(loss_types(loss_type), loss_weights, policy_chosen, policy_rejected, ref_chosen,
                           ref_rejected, beta, label_smoothing, chosen_tokens, rejected_tokens, discopop_tau,
                           simpo_gamma, f_divergence)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


@dataclass(frozen=True)
class DPOLoss:
    """The DPO objective of a packed batch: (2B, T, V) logits, (2B, T) labels (chosen rows first,
    IGNORE on the prompt and padding), (2B,) reference log-probabilities of the same rows -> the
    mean loss over the B pairs (a weighted sum of means for several loss types). `ftx`
    (LlamaFactory's pref_ftx) adds ftx x each pair's chosen NLL averaged over its own tokens,
    -log pi(y+) / n+, as LlamaFactory's DPO trainer adds it: unlike the `sft` loss type (TRL's
    rpo_alpha), which averages over all the batch's chosen tokens, a short answer weighs as much
    as a long one."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    loss_type: str | tuple = "sigmoid"
    loss_weights: tuple | None = None
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    ftx: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    # WPO (Zhou et al., 2024; TRL's use_weighting): each pair's loss times w+ w-, w = exp of the mean
    # over the completion's tokens of log p(token) - log sum_v p(v)^2, constants of the step
    use_weighting: bool = False
    # LD-DPO (Liu et al., 2024; TRL's ld_alpha): a completion's log-probability is the sum over its
    # first tokens, as many as the pair's shorter completion has, plus ld_alpha x the sum over the
    # rest (None: the plain sum), the policy's and the reference's alike
    ld_alpha: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not (isinstance(self.beta, (int, float)) and self.beta > 0):
            raise ArgumentError(f"DPO beta must be a positive number, e.g. 0.1; got {self.beta!r}")
        kinds = loss_types(self.loss_type)
        object.__setattr__(self, "loss_type", kinds[0] if len(kinds) == 1 else kinds)
        ls = self.label_smoothing
        if "exo_pair" in kinds:
            if not (isinstance(ls, (int, float)) and 0.0 < ls < 1.0):
                raise ArgumentError(f"DPO loss_type exo_pair takes label_smoothing in (0, 1), its epsilon (EXO "
                                    f"recommends 1e-3); got {ls!r}")
        elif not (isinstance(ls, (int, float)) and 0.0 <= ls < 0.5):
            raise ArgumentError(f"DPO label_smoothing must be in [0, 0.5); got {ls!r}")
        if self.loss_weights is not None:
            weights = tuple(self.loss_weights)
            if len(weights) != len(kinds):
                raise ArgumentError(f"DPO loss_weights has {len(weights)} weights for {len(kinds)} loss types")
            object.__setattr__(self, "loss_weights", weights)
        check_f_divergence(kinds, self.f_divergence_type, self.f_alpha_divergence_coef)
        if self.ld_alpha is not None:
            if isinstance(self.ld_alpha, bool) or not isinstance(self.ld_alpha, (int, float)) \
                    or not 0 <= self.ld_alpha <= 1:
                raise ArgumentError(f"DPO ld_alpha weighs the tokens past the shorter completion's length, in [0, 1] "
                                    f"(LD-DPO uses values around 0.5); got {self.ld_alpha!r}")
            plain = [k for k in kinds if k in ("sft", "simpo", "orpo", "orpo_per_pair")] + (["pref_ftx"] * bool(self.ftx))
            if plain:
                raise ArgumentError(f"DPO ld_alpha reweighs the completions' log-probabilities, and {', '.join(plain)} "
                                    "read their plain negative log-likelihood: train them without ld_alpha")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(kinds):
            raise ArgumentError("DPO use_weighting (WPO) weighs each pair, and loss types aot and aot_unpaired sort "
                                "the pairs, which would misalign the weights (as TRL refuses them)")
        if not self.discopop_tau > 0:
            raise ArgumentError(f"DPO discopop_tau must be positive (DiscoPOP uses 0.05); got {self.discopop_tau!r}")
        if isinstance(self.ftx, bool) or not (isinstance(self.ftx, (int, float)) and self.ftx >= 0):
            raise ArgumentError(f"DPO pref_ftx (the weight of each pair's chosen NLL) must be a number >= 0; "
                                f"got {self.ftx!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        return loss_types(self.loss_type)

    @property
    def needs_reference(self) -> bool:
        """Whether a loss type reads the reference's log-probabilities (simpo, orpo and sft do not)."""
        return any(k not in REFERENCE_FREE for k in self.kinds)

    @property
    def reads_label_smoothing(self) -> bool:
        return any(k in READS_LABEL_SMOOTHING for k in self.kinds)

    def pairs(self, policy: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor,
              weights: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) losses of (2B,) packed sequence log-probabilities, reference ones and token counts;
        `weights` (B,): WPO's, each pair's losses (not pref_ftx's NLL) times its weight."""
        if policy.shape[0] % 2 or ref.shape != policy.shape:
            raise ArgumentError(f"a DPO batch packs chosen rows then as many rejected rows, with one reference "
                                f"log-probability per row; got {policy.shape[0]} rows and ref_logps of shape "
                                f"{tuple(ref.shape)}")
        half = policy.shape[0] // 2
        losses, _, _ = dpo_loss(policy[:half], policy[half:], ref[:half], ref[half:], self.beta,
                                self.label_smoothing, self.kinds, loss_weights=self.loss_weights,
                                chosen_tokens=tokens[:half], rejected_tokens=tokens[half:],
                                discopop_tau=self.discopop_tau, simpo_gamma=self.simpo_gamma,
                                f_divergence=(self.f_divergence_type, self.f_alpha_divergence_coef))
        if weights is not None:
            losses = losses * weights
        if self.ftx:
            losses = losses - self.ftx * policy[:half] / tokens[:half].clamp(min=1)
        return losses

    def sequences(self, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(2B,) each packed row's log-probability from its (2B, T) per-token ones: their sum, or
        LD-DPO's with ld_alpha."""
        if self.ld_alpha is None:
            return logps.sum(-1)
        position = mask.long().cumsum(-1)                       # 1, 2, ... over each completion's tokens
        lengths = mask.sum(-1)
        half = lengths.shape[0] // 2
        shared = torch.minimum(lengths[:half], lengths[half:]).repeat(2).unsqueeze(-1)
        early = mask & (position <= shared)
        return (logps * early).sum(-1) + self.ld_alpha * (logps * (mask & ~early)).sum(-1)

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
        return self.with_sequences(logits, labels, ref_logps)[0]

    def with_sequences(self, logits: torch.Tensor, labels: torch.Tensor,
                       ref_logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss and the (2B,) rows' log-probabilities it read (sequences())."""
        logps, mask = token_logprobs(logits, labels)
        weights = wpo_weights(logits, logps, mask) if self.use_weighting else None
        rows = self.sequences(logps, mask)
        return self.pairs(rows, ref_logps, mask.sum(-1).to(logps.dtype), weights).mean(), rows


@torch.no_grad()
def wpo_weights(logits: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) WPO's weight of each pair of a packed batch (chosen rows first): w+ w-, w the exp of the
    mean over the completion's tokens of log p(token) - log sum_v p(v)^2 (how likely the completion
    is under the policy, against how peaked each step's distribution is)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_sum_sq = torch.logsumexp(2 * logits, dim=-1) - 2 * torch.logsumexp(logits, dim=-1)
    aligned = ((logps - log_sum_sq) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    w = torch.exp(aligned)
    half = w.shape[0] // 2
    return w[:half] * w[half:]


class DPOObjective(nn.Module):
    """The policy with the DPO loss on top, as one module for compile(): its forward takes the packed
    batch and returns the loss, so the engine trains it like any model whose output is its loss.
    The policy's parameters keep their names under `policy.`. With `hand_out`, the loss comes as
    LossAndOutputs(loss, {"logps": the (2B,) rows' log-probabilities the loss read}): the policy's
    for the logged rewards, out of the training step's own forward."""

    def __init__(self, policy: nn.Module, loss: DPOLoss = DPOLoss(), hand_out: bool = False):
        super().__init__()
        self.policy, self.loss, self.hand_out = policy, loss, hand_out

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, ref_logps: torch.Tensor | None = None,
                **media) -> torch.Tensor:
        """The loss; without ref_logps, each row's log p(completion | prompt), (2B,) (LD-DPO's with
        ld_alpha): the forward-only pass that gives the reference's log-probabilities before training
        moves it, and the policy's on held-out pairs. `media`: a vision-language policy's image
        inputs (pixel_values, image_grid_thw, ...), handed to it as they are."""
        logits = logits_of(self.policy(input_ids, **media))
        if ref_logps is None:
            if self.loss.ld_alpha is None:
                return sequence_logprobs(logits, labels)
            return self.loss.sequences(*token_logprobs(logits, labels))
        if not self.hand_out:
            return self.loss(logits, labels, ref_logps)
        loss, rows = self.loss.with_sequences(logits, labels, ref_logps)
        return LossAndOutputs(loss, {"logps": rows})


def logits_of(output) -> torch.Tensor:
    """A causal LM's logits, whether it returns them or a Hugging Face output holding them."""
    return output if isinstance(output, torch.Tensor) else output.logits
