"""The device arena at run time: one allocation, every tensor of a step at the offset its plan chose.

passes/arena.py gives each device tensor of a step (streamed weights, inputs, restored stashes,
every storage an op of a stage graph makes) an offset in one arena; this holds the arena and
hands out those tensors. Each is a storage of its own over its bytes of the arena, so the ledger
(runtime/memory.py) counts it like any device tensor, by its own address and size, and the
measured peak stays comparable with the planned one; no two of them live at the same time
overlap (ir/verify.py checks the plan).

The arena is allocated once, at the first step of a plan that has one, at that plan's size. Every
plan of an engine (a new input shape, an evaluation step) serves from the same arena: one that needs
more replaces it with a larger one (`regrown` counts it), so the device holds one arena, the
largest, never one per plan. The backend makes the per-tensor storages: the cpu backend over
host memory, the cuda backend over device memory through the CUDA array interface (the tensors do
not own their bytes; the arena does, and the caching allocator leaves them alone).
"""
from __future__ import annotations

import math
import weakref

import torch

from ..ir.arena import DeviceArena


class Arena:
    def __init__(self, backend) -> None:
        # Weakly: the backend holds its arena, and a dropped engine's backend must go at once
        # (runtime/shutdown.py), not wait for the cycle collector.
        self._backend = weakref.ref(backend)
        self.buffer: torch.Tensor | None = None
        self.size = 0
        self.generation = 0        # bumped when the buffer is replaced: storages made before are stale
        self.regrown = 0

    def serve(self, plan: DeviceArena) -> int:
        """Make room for `plan`'s arena (allocated at the first call, replaced by a larger one when a
        plan needs more); returns the generation its storages belong to."""
        if plan.size > self.size:
            if self.buffer is not None:
                self.regrown += 1
            self.buffer = None          # the old arena goes before the new one is allocated
            self._backend().give_back_arena()
            self.buffer = self._backend().empty((plan.size,), torch.uint8)
            self.size = plan.size
            self.generation += 1
        return self.generation

    def storage(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor with a storage of its own over bytes [offset, offset + nbytes) of the arena."""
        assert self.buffer is not None and 0 <= offset and offset + nbytes <= self.size, (offset, nbytes, self.size)
        return self._backend().arena_storage(self.buffer, offset, nbytes)

    @property
    def device_type(self) -> str:
        return self._backend().device.type

    def holds(self, t: torch.Tensor) -> bool:
        """Whether t's storage lies in the arena."""
        if self.buffer is None or t.device != self.buffer.device:
            return False
        start = self.buffer.data_ptr()
        return start <= t.untyped_storage().data_ptr() < start + self.size

    def release(self) -> None:
        self.buffer, self.size = None, 0
        self.generation += 1


def typed(storage: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as `meta` (shape, strides, storage offset, dtype) over `storage`, a uint8
    tensor holding meta's whole storage."""
    out = torch.empty(0, dtype=meta.dtype, device=storage.device)
    return out.set_(storage.untyped_storage(), meta.storage_offset(), meta.shape, meta.stride())


def flat_views(storage: torch.Tensor, metas: list) -> list[torch.Tensor]:
    """The metas' shapes and dtypes as views of one storage: one flat run per dtype, the widest dtypes
    first (so each run starts aligned to its element size), in the metas' order within a run, as
    backend.flat_empty lays a stage's weights out over one buffer per dtype."""
    order = sorted({m.dtype: None for m in metas}, key=lambda d: -d.itemsize)
    starts, offset = {}, 0
    for dtype in order:
        starts[dtype] = offset
        offset += sum(math.prod(m.shape) * dtype.itemsize for m in metas if m.dtype == dtype)
    assert offset <= storage.numel(), (offset, storage.numel())
    out = []
    for m in metas:
        n = math.prod(m.shape)
        out.append(storage[starts[m.dtype]:starts[m.dtype] + n * m.dtype.itemsize].view(m.dtype).view(m.shape))
        starts[m.dtype] += n * m.dtype.itemsize
    return out
