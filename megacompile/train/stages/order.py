"""The order in which a post-training stage reads its pairs or prompts."""
from __future__ import annotations

import torch


def stream_items(n: int, seed: int, position: int, count: int, shuffle: bool = True) -> list[int]:
    """The `count` items from `position` of an endless stream over n items: each epoch a shuffle of
    them seeded by (seed, epoch), so a data position alone says which items come next; without
    `shuffle` (disable_shuffling) each epoch in the files' order."""
    out = []
    for i in range(position, position + count):
        epoch, k = divmod(i, n)
        if not shuffle:
            out.append(k)
            continue
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.append(int(order[k]))
    return out
