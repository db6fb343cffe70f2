"""A batch of rollouts as a GRPO training step's inputs: prompt + completion rows at one width,
labels on the completion tokens, and the advantages of each completion within its prompt's group."""
from __future__ import annotations

import torch

from .grpo import group_advantages
from .logprobs import IGNORE
from .rollout import Completion


def rollout_batch(completions: list[Completion], rewards: torch.Tensor, n: int, width: int,
                  pad_id: int = 0, scale: bool = True) -> dict[str, torch.Tensor]:
    """input_ids and labels (N, width), and advantages (N,); completions of one prompt consecutive."""
    ids = torch.full((len(completions), width + 1), pad_id, dtype=torch.long)
    labels = torch.full((len(completions), width), IGNORE, dtype=torch.long)
    for r, c in enumerate(completions):
        row = (c.prompt + c.tokens)[:width + 1]
        ids[r, :len(row)] = torch.tensor(row)
        if len(row) > len(c.prompt):
            labels[r, len(c.prompt) - 1:len(row) - 1] = torch.tensor(row[len(c.prompt):])
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels,
            "advantages": group_advantages(rewards, n, scale=scale)}
