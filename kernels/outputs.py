"""Where a kernel's results go: fresh tensors, or tensors its caller laid out for them.

A kernel's host function makes each of its results with `empty`, `zeros` or `empty_like` from
here. Outside `into(...)` these are torch's own. Inside, a request whose dtype, device, size and
layout match one of the given tensors not yet taken gets that tensor (zeroed for `zeros`; viewed in
the shape asked, where it is contiguous), the first such one, so results of one size are handed out
in the order they are asked for. A request
nothing matches (a temporary the kernel frees before it returns) is torch's, as outside.

The device arena hands a kernel node its planned result tensors this way (megacompile/runtime/
placement.py), so a fused kernel writes its results where the plan put them, as an ATen op does
through its out= form; a result that still comes back elsewhere is copied in there.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

_given = threading.local()


@contextlib.contextmanager
def into(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Results asked for inside the block come from `tensors` where they match (per thread)."""
    before = getattr(_given, "free", None)
    _given.free = list(tensors)
    try:
        yield
    finally:
        _given.free = before


def _take(shape, dtype: torch.dtype, device, stride=None) -> torch.Tensor | None:
    """The first given tensor laid out as asked: `stride`, or contiguous of the same size, viewed
    in `shape` (a kernel working on rows [M, N] of a [B, S, N] result asks for [M, N])."""
    free = getattr(_given, "free", None)
    if not free:
        return None
    shape, device = tuple(shape), torch.device(device)
    numel = 1
    for d in shape:
        numel *= d
    for i, t in enumerate(free):
        if t.dtype != dtype or t.device != device:
            continue
        if stride is not None and tuple(t.shape) == shape and t.stride() == tuple(stride):
            return free.pop(i)
        if stride is None and t.is_contiguous() and t.numel() == numel:
            return free.pop(i).view(shape)
    return None


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype, device=device), contiguous, or the caller's tensor for it."""
    t = _take(shape, dtype, device)
    return torch.empty(shape, dtype=dtype, device=device) if t is None else t


def empty_strided(shape, stride, *, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty_strided(shape, stride, ...), or the caller's tensor laid out so."""
    t = _take(shape, dtype, device, stride)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device) if t is None else t


def zeros(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    t = _take(shape, dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device) if t is None else t.zero_()


def empty_like(x: torch.Tensor) -> torch.Tensor:
    """torch.empty_like(x) (a dense x keeps its strides), or the caller's tensor for it."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    stride = x.stride() if is_non_overlapping_and_dense_or_false(x) else None
    t = _take(x.shape, x.dtype, x.device, stride)
    return torch.empty_like(x) if t is None else t
