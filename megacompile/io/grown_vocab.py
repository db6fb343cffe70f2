"""A vocabulary grown past the model folder's: the rows of the tokens a run adds to its tokenizer
(LlamaFactory's add_tokens and add_special_tokens with resize_vocab), made as its weights stream in.

The model is built with `rows` token rows (config.vocab_size, set before the build); the folder's
embedding (and an untied output projection) has fewer, or as many where the tokenizer's new ids
fall in rows the model had padded. Each such tensor is read from its file and grown as
transformers' resize_token_embeddings(rows, mean_resizing=False) grows it, then as LlamaFactory
initialises the new tokens' rows:

    rows the file holds        the file's (a new token's row among them is re-made below)
    rows past the file's       drawn from N(0, initializer_range), as the model's _init_weights
                               draws a new embedding (the padding up to a multiple of 64)
    the new tokens' rows       the mean of every other row, plus N(0, 1 / sqrt(hidden)) noise

The draws come from a generator seeded by the run's seed and the tensor's name, so every load of
the folder (the policy's, a DPO reference's, a LoRA run's trained copy) makes the same rows. The
file's rows are read into the grown tensor a block at a time (safetensors' slices), so a grown
tensor is held once while it is made, as any tensor the load reads, then streams into the host
state as any other.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .source import made_as_read

_MARK = "<grown>"      # an item's source: its file, read through GrownVocab.memory
_ROWS = 4096            # rows summed at a time for the mean


@dataclass(frozen=True)
class GrownVocab:
    rows: int                       # the model's token rows
    new_ids: tuple[int, ...]        # the added tokens' ids
    keys: frozenset[str]            # the file keys of the tensors with a row per token
    std: float                      # the config's initializer_range
    seed: int

    def holds(self, key: str, saved: tuple, own: tuple) -> bool:
        """Whether the file's tensor `key`, of shape `saved`, grows into the model's `own`."""
        return key in self.keys and len(saved) == 2 and saved[1:] == own[1:] and saved[0] <= own[0] == self.rows

    def grow(self, key: str, t) -> torch.Tensor:
        """The file's tensor `key` with the model's rows (module docstring), float32. `t`: the tensor,
        or safetensors' slice of it, read a block of rows at a time."""
        stored, dim = tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())
        generator = torch.Generator().manual_seed(_seed(self.seed, key))
        out = torch.empty(self.rows, dim, dtype=torch.float32)
        # A large vocabulary's embedding is gigabytes: neither the file's whole tensor beside the
        # grown one nor a float64 copy of it, only a block of rows at a time.
        for start in range(0, stored, _ROWS):
            end = min(start + _ROWS, stored)
            out[start:end] = t[start:end]
        if self.rows > stored:
            out[stored:] = torch.randn(self.rows - stored, dim, generator=generator) * self.std
        if self.new_ids:
            ids = torch.tensor(sorted(set(self.new_ids)))
            total = torch.zeros(dim, dtype=torch.float64)      # the other rows' mean, summed in float64
            for start in range(0, self.rows, _ROWS):
                total += out[start:start + _ROWS].sum(dim=0, dtype=torch.float64)
            total -= out[ids].sum(dim=0, dtype=torch.float64)
            mean = (total / (self.rows - len(ids))).float()
            noise = torch.randn(len(ids), dim, generator=generator) / math.sqrt(dim)
            out[ids] = mean + noise
        return out

    def route(self, items: list) -> tuple[list, dict]:
        """The load's items with those of the grown tensors read through `memory` (io/source.py's
        PendingLoad.memory), each grown from its file's slice: (items, memory)."""
        return made_as_read(items, self.keys, _MARK, lambda f, key: self.grow(key, f.get_slice(key)))


def _seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "little") & (2 ** 63 - 1)
