"""A batch of rollouts as a GRPO training step's inputs: prompt + completion rows at one width,
labels on the completion tokens, and the advantages of each completion within its prompt's group."""
from __future__ import annotations

import torch

from .advantages import group_advantages
from .logprobs import IGNORE
from .rollout import Completion, stop_ids


def truncated(completions: list[Completion], eos_id, pad_id: int | None) -> list[bool]:
    """TRL's test of a truncated completion: its last token is neither a stop token (`eos_id`, as
    rollout.stop_ids takes it) nor the pad token (it stopped at max_completion_length)."""
    ends = set(stop_ids(eos_id)) | ({pad_id} if pad_id is not None else set())
    return [not c.tokens or c.tokens[-1] not in ends for c in completions]


def rollout_batch(completions: list[Completion], rewards: torch.Tensor, n: int, width: int,
                  pad_id: int = 0, scale: str | bool = "group", masked: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """input_ids and labels (N, width), and advantages (N,); completions of one prompt consecutive.
    masked: completions whose tokens the loss leaves out (mask_truncated_completions: no label at
    all), though their rewards still count in their group's statistics, as in TRL."""
    ids = torch.full((len(completions), width + 1), pad_id, dtype=torch.long)
    labels = torch.full((len(completions), width), IGNORE, dtype=torch.long)
    for r, c in enumerate(completions):
        row = (c.prompt + c.tokens)[:width + 1]
        ids[r, :len(row)] = torch.tensor(row)
        if len(row) > len(c.prompt) and not (masked is not None and masked[r]):
            labels[r, len(c.prompt) - 1:len(row) - 1] = torch.tensor(row[len(c.prompt):])
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels,
            "advantages": group_advantages(rewards, n, scale=scale)}
