"""What a rollout may draw besides the temperature: TRL's generation keys, as transformers' `generate`
applies them (TRL's default generator), in its order, to one step's logits [rows, V]:

    repetition_penalty   on the raw logits: each token already in the row (prompt and completion so
                         far) has its logit divided by the penalty where positive, multiplied where
                         negative (1.0: off)
    temperature          the logits divided by it (the caller's; 0 is greedy: argmax after the penalty)
    top_k                only the k largest logits kept (0: off)
    top_p                the smallest set of tokens whose probability adds up to more than 1 - top_p
                         removed, the largest always kept (1.0: off)
    min_p                tokens less likely than min_p x the likeliest removed (None: off)

A removed token's logit is -inf. vLLM takes the same four settings and applies them in its own
order (penalties, temperature, min_p, then top-k and top-p together); `vllm_settings` is what it is
handed. The training log-probabilities are the policy's at the temperature, unfiltered, as TRL's."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ArgumentError


@dataclass(frozen=True)
class Filters:
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self):
        check(self.top_k, self.top_p, self.min_p, self.repetition_penalty)

    @property
    def active(self) -> bool:
        return self != Filters()

    def penalise(self, logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """logits [rows, V] with the repetition penalty on the tokens `seen` [rows, V] (bool) holds."""
        if self.repetition_penalty == 1.0:
            return logits
        penalised = torch.where(logits < 0, logits * self.repetition_penalty, logits / self.repetition_penalty)
        return torch.where(seen, penalised, logits)

    def truncate(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, V], after the temperature, with top_k, top_p and min_p's removed tokens at -inf."""
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        if self.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=False)
            below = ordered.softmax(-1).cumsum(-1) <= 1 - self.top_p
            below[..., -1] = False                               # the likeliest token stays
            logits = logits.masked_fill(below.scatter(-1, order, below), -math.inf)
        if self.min_p is not None:
            probs = logits.softmax(-1)
            floor = self.min_p * probs.amax(-1, keepdim=True)
            removed = (probs < floor).scatter(-1, probs.argmax(-1, keepdim=True), False)
            logits = logits.masked_fill(removed, -math.inf)
        return logits

    def draw(self, logits: torch.Tensor, seen: torch.Tensor | None, temperature: float,
             rng: torch.Generator) -> torch.Tensor:
        """One token per row of logits [rows, V] (fp32): greedy at temperature 0, else drawn with `rng`."""
        if seen is not None:
            logits = self.penalise(logits, seen)
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(self.truncate(logits / temperature), -1)
        return torch.multinomial(probs, 1, generator=rng).squeeze(1)

    def vllm_settings(self) -> dict:
        """vLLM's SamplingParams fields (top_k -1: off, in every vLLM version)."""
        return dict(top_k=self.top_k or -1, top_p=self.top_p, min_p=self.min_p or 0.0,
                    repetition_penalty=self.repetition_penalty)


def seen_tokens(rows: list[list[int]], vocab: int, device=None) -> torch.Tensor:
    """[rows, vocab] bool: the tokens each row holds (its prompt and completion so far)."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for r, row in enumerate(rows):
        if row:
            seen[r, torch.tensor(row, device=device)] = True
    return seen


def check(top_k, top_p, min_p, repetition_penalty) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ArgumentError(f"top_k is the number of likeliest tokens a rollout draws from, a whole number >= 0 "
                            f"(0: every token, TRL's default); got {top_k!r}")
    if not _number(top_p) or not 0 < top_p <= 1:
        raise ArgumentError(f"top_p must be in (0, 1] (1.0: every token, TRL's default); got {top_p!r}")
    if min_p is not None and (not _number(min_p) or not 0 <= min_p <= 1):
        raise ArgumentError(f"min_p must be in [0, 1] (tokens less likely than min_p x the likeliest are not drawn; "
                            f"0.01 to 0.2 are usual), or left out; got {min_p!r}")
    if not _number(repetition_penalty) or not repetition_penalty > 0:
        raise ArgumentError(f"repetition_penalty must be a positive number (1.0: off, TRL's default; above 1 draws "
                            f"tokens already in the row less often); got {repetition_penalty!r}")


def _number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
