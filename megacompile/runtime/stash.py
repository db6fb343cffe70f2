"""A stash moves storages, not tensors: what the plan counts, each byte once.

A stage's saved bundle often holds several views of one storage (q, k and v of one projection;
an attention output and its reshape for the next matmul). The plan counts a value by the
storages it keeps alive (ir/program.py), so the stash copies each distinct device storage once,
whole, as flat bytes, and the restore rebuilds every tensor on the restored storage with its
dtype, shape, strides and offset: the backward reads the same layouts, the device holds the same
bytes as before the stash, and the host holds exactly the plan's stash figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OnStorage:
    """Where a stashed tensor sat: on the index-th stashed storage."""
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def stash_storages(tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], list[Any]]:
    """(the distinct device storages as flat uint8 tensors, each tensor's place): a place is an
    OnStorage, or the tensor itself where it is not on `device` (a host tensor in the bundle, an
    SDPA philox seed, stays as it is)."""
    storages: list[torch.Tensor] = []
    seen: dict[int, int] = {}
    places: list[Any] = []
    for t in tensors:
        if t.device != device:
            places.append(t)
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen or not key:        # no address (a meta tensor): never shared
            seen[key] = len(storages)
            storages.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        places.append(OnStorage(seen[key], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()))
    return storages, places


def rebuild(places: list[Any], storages: list[torch.Tensor]) -> list[torch.Tensor]:
    """The stashed tensors again, as views of `storages` (flat uint8, restored in stash order)."""
    out = []
    for p in places:
        if not isinstance(p, OnStorage):
            out.append(p)
            continue
        flat = storages[p.index]
        out.append(torch.empty(0, dtype=p.dtype, device=flat.device).set_(flat.untyped_storage(), p.offset,
                                                                            p.shape, p.stride))
    return out
