"""Dynamic fine-tuning (Wu et al., 2025; TRL's SFTConfig loss_type "dft", LlamaFactory's
use_dft_loss): supervised fine-tuning whose per-token cross-entropy is weighted by the token's own
probability under the model, held constant in the gradient,

    loss = -sum_t p_t.detach() * log p_t / (counted tokens),

so a token the model finds unlikely pulls less than in plain cross-entropy. Its gradient with
respect to the logits is the cross-entropy's scaled by p_t per token."""
from __future__ import annotations

import torch
from torch import nn

from .dpo import logits_of
from .logprobs import token_logprobs

__all__ = ["DFTObjective", "dft_loss"]


def dft_loss(logits: torch.Tensor, labels: torch.Tensor, *, weighted: bool = True) -> torch.Tensor:
    """(B, T, V) logits and (B, T) labels, already shifted (IGNORE where no token counts) -> the
    mean over the counted tokens of -p.detach() * log p in fp32; weighted=False: the plain
    cross-entropy over the same tokens."""
    logps, mask = token_logprobs(logits, labels)
    per_token = -logps.detach().exp() * logps if weighted else -logps
    return (per_token * mask).sum() / mask.sum()


class DFTObjective(nn.Module):
    """A causal LM with the DFT loss on top, for compile(): forward(input_ids, labels, **inputs) ->
    the loss. The model is called without labels (its own cross-entropy would be computed and
    dropped) and with every other input (positions, pixels). shifted: the labels are already
    the next tokens (the bundled model's); otherwise, as Hugging Face models take them, labels[t]
    is the token at t and the model's logits at t predict labels[t + 1].

    In eval mode the same forward gives the plain cross-entropy of the counted tokens: a held-out
    loss, and its perplexity, that compare with a cross-entropy run's."""

    def __init__(self, policy: nn.Module, shifted: bool = False):
        super().__init__()
        self.policy, self.shifted = policy, shifted

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs) -> torch.Tensor:
        logits = logits_of(self.policy(input_ids, **inputs))
        if not self.shifted:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of shifted logits and labels: DFT's in training, the cross-entropy in eval mode."""
        return dft_loss(logits, labels, weighted=self.training)
