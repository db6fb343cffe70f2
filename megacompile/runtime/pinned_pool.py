"""Page-locked host buffers for stashed activations, at their exact sizes, reused step to step.

A stash (offload(..., keep=True)) copies a device tensor into host memory that the device reads
back before the backward. torch's pinned caching allocator would round each of those buffers up
to a power of two and keep it (1.3x the plan's stash figure at 14B, 16 x 4096 tokens), so the
pool registers buffers of exactly the tensor's bytes (page_locked.pinned_empty) and lends them out by
size. A buffer comes back when its stash is restored: the restore's copy may still be reading it,
so it comes back with the event of that copy, and whoever takes it next orders its own copy
after that event (a stream-side wait). The schedule is the same every step, so after the first
step the pool holds exactly what the plan counts for the stash at its peak and allocates nothing.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .page_locked import pinned_empty


class PinnedPool:
    def __init__(self, allocate: Callable[[int, torch.dtype], torch.Tensor] = pinned_empty):
        self._allocate = allocate
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}    # bytes -> (flat buffer, event)
        self._lent: dict[int, torch.Tensor] = {}                      # data_ptr -> its flat buffer
        self.allocated_bytes = 0      # page-locked bytes the pool holds, lent or not

    def take(self, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """A host tensor with like's shape and dtype (and its strides, when like is dense: a
        transpose comes back with its layout), and the event the buffer's last reader marked,
        which the copy into it must wait on (None for a fresh buffer)."""
        from torch._prims_common import is_non_overlapping_and_dense_or_false
        nbytes = like.numel() * like.element_size()
        if nbytes == 0:      # nothing to copy, nothing to pin
            return torch.empty(like.shape, dtype=like.dtype), None
        free = self._free.get(nbytes)
        if free:
            flat, pending = free.pop()
        else:
            flat, pending = self._allocate(nbytes, torch.uint8), None
            self.allocated_bytes += nbytes
        typed = flat.view(like.dtype)
        stride = like.stride() if is_non_overlapping_and_dense_or_false(like) else _contiguous(like.shape)
        out = typed.as_strided(like.shape, stride)
        self._lent[out.data_ptr()] = flat
        return out, pending

    def give_back(self, tensors: list[torch.Tensor], after: Any = None) -> None:
        """Buffers taken from the pool are free again once `after` (the event of the copy that
        reads them last) is done; tensors the pool did not lend are ignored."""
        for t in tensors:
            flat = self._lent.pop(t.data_ptr(), None)
            if flat is not None:
                self._free.setdefault(flat.numel(), []).append((flat, after))

    @property
    def lent_bytes(self) -> int:
        return sum(flat.numel() for flat in self._lent.values())


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))
