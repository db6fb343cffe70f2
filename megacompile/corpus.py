"""The byte-level text corpus shipped inside the package, and random training windows over it."""
from __future__ import annotations

from importlib import resources

import torch


def load_corpus() -> torch.Tensor:
    """The bundled corpus as a 1-D uint8 tensor of bytes (tokens are bytes: vocab 256)."""
    data = resources.files("megacompile").joinpath("data/corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batches(corpus: torch.Tensor, batch: int, seq: int, seed: int = 0):
    """Endless (input_ids, labels) pairs of shape (batch, seq); labels are the next bytes."""
    if corpus.numel() < seq + 2:
        raise ValueError(f"the corpus has {corpus.numel()} bytes, fewer than seq + 2 = {seq + 2}")
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=g)
        windows = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()  # (batch, seq + 1)
        yield windows[:, :-1], windows[:, 1:]
