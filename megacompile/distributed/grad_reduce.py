"""Gradients summed across the ranks as the backward produces them, on the device.

When a stage's gradients are complete on the device (where one process offloads them to the
host), each is summed over the ranks into the rank that holds its master and moments (shard.py:
whole tensors, so one reduce per tensor, to its holder: the reduce-scatter of the owner's flat
gradient by the shares' ranges, without packing the tensors into one buffer). The reduces run
on the backend's network stream (NCCL on a GPU, gloo on the cpu backend), issued async right
after the stage's backward, so the sum of block i overlaps the backward of block i-1; the holder
divides by the number of ranks there, and only its own tensors then cross the device->host link
(runtime/host.py's offload_grads, ordered after the reduce), into its share of the gradient
buffers. Every rank issues the same reduces in the same order: every rank runs the same plan.

Each micro-batch's gradients are reduced (docs/decisions.md: a step's sum cannot stay on the
device, and summing it on the host would need every rank to keep a whole gradient there).
The tensors are reduced in the dtype they leave the backward in (bf16 with bf16 compute).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._prims_common import is_non_overlapping_and_dense_or_false

if TYPE_CHECKING:
    from ..runtime.backend import Backend, Event
    from .group import Ranks


def reduce_to_holders(ranks: "Ranks", backend: "Backend", grads: list[torch.Tensor], holders: list[int],
                      stage: str) -> tuple["Event", list[torch.Tensor]]:
    """Sum each device tensor over the ranks into its holder's copy, divided there by the number
    of ranks; the others' copies are left undefined. Returns the reduce's event and the tensors
    that hold the result (the gradients themselves, or a contiguous copy of one that is not dense)."""
    group = ranks.device_group(backend.device)
    sent = [g if is_non_overlapping_and_dense_or_false(g) else g.contiguous() for g in grads]
    # A dense tensor's elements are one run of its storage, laid out alike on every rank (the same
    # plan): the run is summed elementwise, whatever the strides.
    flats = [t.as_strided((t.numel(),), (1,), t.storage_offset()) for t in sent]
    dsts = [ranks.members[h] for h in holders]
    mine = [f for f, h in zip(flats, holders) if h == ranks.rank]
    what = f"summing the gradients of {stage}"

    def issue(tensors: list[torch.Tensor]):
        works = [dist.reduce(t, dst=d, group=group, async_op=True) for t, d in zip(tensors, dsts)]

        def finish() -> None:
            for w in works:
                ranks.call(what, w.wait)
            for t in mine:
                t.div_(ranks.size)
        return finish
    return backend.reduce(flats, issue, f"reduce {stage}"), sent
