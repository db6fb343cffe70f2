"""Stage grpo's rollout rows cut after their longest completion (trim_padding), as the other stages
cut theirs (data/trim.py).

A rollout row is its prompt from column 0, its completion, then padding to max_prompt_length +
max_completion_length (posttrain/rollout_batch.py); its labels mark the completion's tokens, and
every per-token input of the loss (old_logps, ref_logps, the sampler's ratio and log-probabilities)
is laid out on the same columns. The policy is causal and a padding column is never a target, so the
columns after the last completion token of every row change no log-probability, ratio, mask or sum
the loss takes: cut, they are work not done. dr_grpo divides by max_completion_length, a key, not
the row's width, and every other normalisation counts the completion tokens, which are all kept.

A step's micro-batches are cut to one of the few lengths (trim.PARTS) that holds the longest of
them: one program for all of them. The forward-only passes of the old policy and of the reference
are cut each to its own rows' length, and their log-probabilities padded back to the row's width
with zeros in the cut columns, where no label is (the rollout batch is kept whole; the step cuts
it). Rows with images stay whole: their image inputs are laid out for the whole row."""
from __future__ import annotations

import torch

from ..data import trim


def step_parts(parts: list[dict], on: bool) -> list[dict]:
    """A step's micro-batches of rollout rows (input_ids, labels, the per-token inputs; advantages
    and token_count as they are), all cut to the one length that holds the longest completion of
    any. As they are when `on` is false."""
    if not on or not parts:
        return parts
    columns = trim.length(max(trim.needed(p) for p in parts), parts[0]["input_ids"].shape[1])
    return [trim.trimmed(p, columns) for p in parts]


def forward_logps(engine, input_ids: torch.Tensor, labels: torch.Tensor, media: dict, on: bool) -> torch.Tensor:
    """(rows, width) per-token log-probabilities of rollout rows under `engine`, its forward run on
    the rows cut after their longest completion (where `on`, and none shows images), zeros in the
    columns cut."""
    width = input_ids.shape[1]
    if not on or media:
        return torch.as_tensor(engine(input_ids=input_ids, labels=labels, **media)).float().clone()
    rows = trim.trimmed({"input_ids": input_ids, "labels": labels},
                        trim.length(trim.needed({"labels": labels}), width))
    with trim.own_lengths():
        cut = torch.as_tensor(engine(**rows)).float()
    out = torch.zeros(input_ids.shape[0], width, dtype=cut.dtype)
    out[:, :cut.shape[1]] = cut
    return out
