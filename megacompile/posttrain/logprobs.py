"""Log-probabilities of the tokens a sequence holds, from a causal LM's logits."""
from __future__ import annotations

import torch

IGNORE = -100


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) logits and (B, T) labels, already shifted (labels[t] is the token after position
    t; IGNORE where no token counts) -> the log-probability of each label in fp32, and the mask of
    those that count. Computed as a gather minus a logsumexp: the (B, T, V) log-softmax is never
    held."""
    mask = labels != IGNORE
    safe = labels.masked_fill(~mask, 0)
    logits = logits.float()
    picked = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return picked * mask, mask


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The sum over each sequence's counted tokens: log p(completion | prompt), (B,)."""
    logps, _ = token_logprobs(logits, labels)
    return logps.sum(-1)
