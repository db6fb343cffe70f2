"""What the runtime needs from a device: streams, events, copies, memory, random state.

Everything above this interface (the executor, the host state, the optimizer) is shared by the
`cpu` and `cuda` backends. A stream runs its work in order; an Event marks the end of one
piece of work and can be waited on by the compute stream.
"""
from __future__ import annotations

import contextlib
import math
import time
from abc import ABC, abstractmethod
from typing import Callable

import torch

from .arena import Arena
from .memory import DeviceMemory
from .timeline import Span, Timeline  # noqa: F401 - Span is read through here too


def dense_like(t: torch.Tensor, device: torch.device | str = "cpu", pin: bool = False) -> torch.Tensor:
    """An empty tensor with t's layout when t is dense (a transpose keeps its strides, so kernels
    read it exactly as before), else contiguous: numel * itemsize bytes either way."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false
    if is_non_overlapping_and_dense_or_false(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin)
    return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)


def coalesce(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The copies dst <- src as few: runs of pairs that sit back to back in one storage on both
    sides (a stage's weight slot is one flat buffer per dtype, its host source a slice of its
    owner's flat buffer) become one flat copy each. One cudaMemcpyAsync per run, not per parameter."""
    def flat(t: torch.Tensor, numel: int) -> torch.Tensor:
        return t.as_strided((numel,), (1,), t.storage_offset())

    def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
                and b.storage_offset() == a.storage_offset() + a.numel())

    runs: list[list[tuple[torch.Tensor, torch.Tensor, bool]]] = []
    for d, s in zip(dsts, srcs, strict=True):
        flattens = d.dtype == s.dtype and d.is_contiguous() and s.is_contiguous()
        last = runs[-1][-1] if runs else None
        if flattens and last is not None and last[2] and follows(last[0], d) and follows(last[1], s):
            runs[-1].append((d, s, True))
        else:
            runs.append([(d, s, flattens)])
    out = []
    for run in runs:
        numel = sum(d.numel() for d, _, _ in run)
        out.append(run[0][:2] if len(run) == 1 else (flat(run[0][0], numel), flat(run[0][1], numel)))
    return out


def flat_empty(backend: "Backend", metas: list) -> list[torch.Tensor]:
    """Uninitialised device tensors of the metas' shapes and dtypes, as views of one flat buffer per
    dtype (one allocation per stage, not per parameter; the ledger counts each buffer once, the
    same bytes as the tensors one by one)."""
    sizes: dict[torch.dtype, int] = {}
    for m in metas:
        sizes[m.dtype] = sizes.get(m.dtype, 0) + math.prod(m.shape)
    buffers = {dtype: backend.empty((n,), dtype) for dtype, n in sizes.items()}
    offsets = dict.fromkeys(sizes, 0)
    out = []
    for m in metas:
        o, n = offsets[m.dtype], math.prod(m.shape)
        out.append(buffers[m.dtype][o:o + n].view(m.shape))
        offsets[m.dtype] = o + n
    return out


class Event(ABC):
    @abstractmethod
    def wait(self) -> None:
        """Block the compute stream until the work this event marks is done."""


class Backend(ABC):
    name: str
    device: torch.device

    def __init__(self, budget_bytes: int):
        self.memory = DeviceMemory(budget_bytes)
        self.timeline = Timeline()
        self.arena = Arena(self)          # the step's device tensors at their planned offsets

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised device tensor (the caller holds it in self.memory)."""

    @abstractmethod
    def arena_storage(self, arena: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 device tensor over bytes [offset, offset + nbytes) of `arena` with a storage of its
        own (runtime/arena.py): the ledger tells planned tensors apart by their storages."""

    def give_back_arena(self) -> None:
        """An arena was dropped: its memory goes back before a larger one is allocated."""

    @abstractmethod
    def prefetch(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], what: str) -> Event:
        """Copy host tensors into device tensors on the host-to-device stream."""

    @abstractmethod
    def offload(self, srcs: list[torch.Tensor], sink: Callable[[list[torch.Tensor]], None], what: str,
                keep: bool = False, dsts: list[torch.Tensor | None] | None = None, after: Event | None = None) -> Event:
        """Copy device tensors to host memory on the device-to-host stream, then hand the host
        copies to `sink` off the compute thread. With `keep` the copies are the sink's to keep
        (stashed activations, which only the device reads back: the sink may get them before
        the copy has written them, for device work ordered after the returned event); otherwise they are only valid during the call (gradients, added
        into the fp32 grads). `dsts`, where not None, are host tensors (page-locked on cuda)
        the copies land in directly: a gradient lands in its final buffer, not in staging. With
        `after` (an event of reduce()), the copies start once it is done."""

    def release_stash(self, host: list[torch.Tensor], after: Event | None) -> None:
        """The host copies of a stash (offload(keep=True)) are no longer needed once `after`, the
        restore's copy that reads them, is done (None: nothing reads them any more). The cuda
        backend lends them out again (runtime/pinned_pool.py); the cpu backend keeps none."""

    @abstractmethod
    def reduce(self, tensors: list[torch.Tensor], issue: Callable[[list[torch.Tensor]], Callable[[], None]],
               what: str) -> Event:
        """A collective over device tensors (data parallelism: gradients summed across the ranks,
        distributed/grad_reduce.py) on the communication stream, after the compute stream's work
        so far: issue(tensors) starts it (async collectives) and returns what completes it (their
        waits, then device work on the result). The event marks its end; offload(after=) orders
        copies of the result behind it."""

    @abstractmethod
    def host_task(self, work: Callable[[], None], what: str) -> Event:
        """Run host work (the optimizer) on the host stream, in order, off the compute thread."""

    @abstractmethod
    def to_device(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A synchronous copy of a (small) host tensor to the device: the model inputs; into `out`
        (its arena tensor) where given."""

    @abstractmethod
    def synchronize(self, host: bool = True) -> None:
        """Wait for the copy streams, and with `host` for the host (optimizer) stream too."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor: ...

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None: ...

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a (small) device tensor, the step's outputs: valid after synchronize()."""
        return t.detach().to("cpu", copy=True)

    def scope(self) -> contextlib.AbstractContextManager:
        """Entered around a step: makes the backend's device current (kernels launch there)."""
        return contextlib.nullcontext()

    def allocator_stats(self) -> dict:
        """The device allocator's own peaks, beside the ledger's (none on the simulated device)."""
        return {}

    def reset_allocator_peak(self) -> None:
        pass

    def give_back_freed(self) -> None:
        """A step's device values are all dropped: memory they freed may go back (cpu backend)."""

    def begin_step(self, program=None) -> None:
        """A step starts: the timeline's record of the last one goes (runtime/timeline.py)."""
        self.timeline.begin(program, time.perf_counter())

    def clock(self):
        """A mark before a stage's work, handed back to compute_span() after it."""
        return time.perf_counter()

    def compute_span(self, what: str, start) -> None:
        self.timeline.add("compute", what, start, time.perf_counter())

    def close(self) -> None:
        """Stop worker threads."""
