"""Entropy-adaptive fine-tuning (LlamaFactory's use_eaft_loss, eaft_alpha): supervised fine-tuning
whose per-token cross-entropy is weighted by how uncertain the model is at that position, held
constant in the gradient,

    loss = sum_t w_t.detach() * -log p_t / (counted tokens),   w_t = (H_t / 3) ** alpha,

where H_t is the entropy of the model's 20 most likely next tokens, renormalised among themselves
(an estimate of the whole distribution's that reads 20 logits, not the vocabulary). A token the
model predicts with confidence pulls less; where it hesitates between many, more. alpha 0 is
the plain cross-entropy."""
from __future__ import annotations

import torch

from .dft import DFTObjective
from .logprobs import token_logprobs

__all__ = ["EAFTObjective", "eaft_loss", "eaft_weights"]

TOP = 20            # the logits the entropy is estimated from
SCALE = 3.0         # the entropy is divided by this before the power (LlamaFactory's constant)


def eaft_weights(logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """(..., V) logits -> (...) weights (H / 3) ** alpha, held constant (no gradient): in fp32 from
    lower precisions, in the logits' own dtype from fp32 up."""
    logits = logits.detach()
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    top = torch.topk(logits, k=min(TOP, logits.shape[-1]), dim=-1).values
    logp = top - torch.logsumexp(top, dim=-1, keepdim=True)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.pow(entropy / SCALE, alpha)


def eaft_loss(logits: torch.Tensor, labels: torch.Tensor, alpha: float, *, weighted: bool = True) -> torch.Tensor:
    """(B, T, V) logits and (B, T) labels, already shifted (IGNORE where no token counts) -> the
    mean over the counted tokens of w * -log p in fp32; weighted=False: the plain cross-entropy
    over the same tokens."""
    logps, mask = token_logprobs(logits, labels)
    per_token = -logps * eaft_weights(logits, alpha) if weighted else -logps
    return (per_token * mask).sum() / mask.sum()


class EAFTObjective(DFTObjective):
    """A causal LM with the EAFT loss on top, for compile(): as DFTObjective (the model called
    without labels, the shift a Hugging Face model makes, the plain cross-entropy in eval mode)
    with EAFT's weights in place of DFT's."""

    def __init__(self, policy: torch.nn.Module, alpha: float, shifted: bool = False):
        super().__init__(policy, shifted)
        self.alpha = alpha

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return eaft_loss(logits, labels, self.alpha, weighted=self.training)
