"""Idefics3's and SmolVLM's patch positions, placed at static shapes.

Their vision embeddings give each real patch of an image a position on the tower's learned grid
of `num_patches_per_side` squared: an image of h x w real patches is spread over the whole grid,
its patch (i, j) at the bucket of i / h in rows and of j / w in columns. Some transformers releases
(5.17) write those positions with a boolean-mask `index_put`, `position_ids[mask] = pos_ids[mask]`,
whose gather has a length read from the mask's values (aten.nonzero), which fake tensors refuse;
later ones write `torch.where(mask, pos_ids, position_ids)`, the same positions at static shapes.
The releases differ in one more step: 5.17 casts the fractional coordinates to the pixels' dtype
before bucketing them (in bfloat16 or float16 some land in the next bucket), later ones bucket
them in float32.

While capturing, `static_positions` runs the embeddings with the `torch.where` form, the
coordinates cast or not as the installed forward does. Which it does is found by running the
installed forward itself, eagerly, on a stand-in module (no patch features; the position
embedding is the position id itself) over every count of real patch rows and columns the tower
takes, in the pixels' dtype: the form whose positions equal the installed forward's there is the
one traced. Positions are integers and carry no gradient, so equal positions give eager's
embeddings and gradients. Where neither form gives the installed forward's positions, the
capture is refused.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..errors import CaptureError


def placed(emb, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor, cast: bool) -> torch.Tensor:
    """The embeddings' forward with the positions written by `torch.where`: pixel_values [images,
    3, H, W], patch_attention_mask [images, H / patch, W / patch] -> [images, patches, width].
    `cast`: bucket the fractional coordinates in the pixels' dtype (else in float32)."""
    images, _, height, width = pixel_values.shape
    device = pixel_values.device
    features = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2)      # [images, patches, width]
    side = emb.num_patches_per_side
    edges = torch.arange(1 / side, 1.0, 1 / side, device=device)                # the grid's bucket edges
    rows = patch_attention_mask[:, :, 0].sum(dim=1)                              # [images]: real patch rows
    cols = patch_attention_mask[:, 0, :].sum(dim=1)                              # [images]: real patch columns

    def fractions(count: int, real: torch.Tensor) -> torch.Tensor:
        """[images, count]: each patch index over the image's real extent, below 1."""
        at = torch.arange(count, device=device, dtype=torch.float32)[None, :] * (1.0 / real)[:, None]
        at = torch.clamp(at, max=(1.0 - 1e-6))
        return at.to(pixel_values.dtype) if cast else at
    row_bucket = torch.bucketize(fractions(patch_attention_mask.size(1), rows), edges, right=True)
    col_bucket = torch.bucketize(fractions(patch_attention_mask.size(2), cols), edges, right=True)
    grid = (row_bucket[:, :, None] * side + col_bucket[:, None, :]).reshape(images, -1)
    padding = torch.zeros(images, (height // emb.patch_size) * (width // emb.patch_size), dtype=grid.dtype,
                          device=device)
    positions = torch.where(patch_attention_mask.view(images, -1), grid, padding)
    return features + emb.position_embedding(positions)


class _StandIn:
    """An embeddings module of `side` patches a side, one pixel a patch, whose patches embed to
    zero and whose position embedding is the position id: its forward returns the positions."""
    patch_size = 1

    def __init__(self, side: int):
        self.num_patches_per_side = side

    @staticmethod
    def patch_embedding(pixels: torch.Tensor) -> torch.Tensor:
        return torch.zeros(pixels.shape[0], 1, *pixels.shape[2:], dtype=torch.float64)

    @staticmethod
    def position_embedding(position_ids: torch.Tensor) -> torch.Tensor:
        return position_ids.unsqueeze(-1).to(torch.float64)


def _every_count(side: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels and patch masks of 2 * side images: image k has k + 1 real rows, and k + 1 or
    side - k real columns, so each axis takes every count from 1 to side."""
    mask = torch.zeros(2 * side, side, side, dtype=torch.bool)
    for k in range(side):
        mask[k, :k + 1, :k + 1] = True
        mask[side + k, :k + 1, :side - k] = True
    return torch.zeros(2 * side, 1, side, side, dtype=dtype), mask


@functools.lru_cache(maxsize=None)
def casts_coordinates(forward: Callable, side: int, dtype: torch.dtype) -> bool | None:
    """Whether `forward` (an embeddings class's) buckets the coordinates in the pixels' dtype (True)
    or in float32 (False), from the positions it places on every patch count; None where neither
    form places them as it does."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        stand_in = _StandIn(side)
        pixels, mask = _every_count(side, dtype)
        try:
            given = forward(stand_in, pixels, mask)
        except Exception:  # noqa: BLE001 - a forward that reads more of its module is not the one known
            return None
        return next((cast for cast in (False, True) if torch.equal(placed(stand_in, pixels, mask, cast), given)),
                    None)


@contextlib.contextmanager
def static_positions(embeddings: nn.Module, name: str):
    """While the tower runs in the trace: `embeddings` (an Idefics3 or SmolVLM vision embeddings
    module at `name`) places its positions at static shapes, as its own forward places them."""
    cls = type(embeddings)

    def forward(pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor) -> torch.Tensor:
        cast = casts_coordinates(cls.forward, embeddings.num_patches_per_side, pixel_values.dtype)
        if cast is None:
            raise CaptureError(
                f"{cls.__name__} ('{name}') places its patches' positions otherwise than the forms megacompile "
                "traces at static shapes (transformers 5.17's and 5.24's), on some count of real patches: train it "
                "with a transformers release whose forward places them as one of those does")
        return placed(embeddings, pixel_values, patch_attention_mask, cast)

    embeddings.forward = forward
    try:
        yield
    finally:
        del embeddings.forward   # back to the class's forward
