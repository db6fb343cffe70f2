"""The `cpu` backend: a device simulated in host memory, for machines without a GPU.

Device tensors are ordinary CPU tensors, but every one is counted against the budget exactly
as on a GPU (runtime/memory.py), and host<->device copies run on their own threads, so the
schedule's overlap of transfers with compute is real and shows in the timeline.
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

from .backend import Backend, Event, coalesce, dense_like
from .host_heap import give_back_freed
from .stream import ThreadStream


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, budget_bytes: int):
        super().__init__(budget_bytes)
        self.device = torch.device("cpu")
        self.h2d = ThreadStream("h2d", self.timeline)
        self.d2h = ThreadStream("d2h", self.timeline)
        self.host = ThreadStream("host", self.timeline, threads=None)   # the optimizer, on every core
        self.network: ThreadStream | None = None    # collectives (data parallelism), made at the first

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def arena_storage(self, arena: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        # A buffer over the arena's bytes: torch makes a storage of its own that does not own them.
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(arena.data_ptr() + offset), dtype=torch.uint8)

    def prefetch(self, dsts, srcs, what) -> Event:
        def copy() -> None:
            for d, s in coalesce(dsts, srcs):
                d.copy_(s)
        return self.h2d.submit(copy, what)

    def offload(self, srcs, sink: Callable[[list[torch.Tensor]], None], what, keep: bool = False,
                dsts=None, after: Event | None = None) -> Event:
        # The simulated device is host memory: the sink reads the device tensors directly, or,
        # to keep them or where a destination is given, gets real host copies (the transfer).
        if keep:
            copy = lambda: sink([dense_like(t).copy_(t) for t in srcs])  # noqa: E731
        elif dsts is not None:
            copy = lambda: sink([t if d is None else d.copy_(t) for t, d in zip(srcs, dsts)])  # noqa: E731
        else:
            copy = lambda: sink(srcs)  # noqa: E731
        if after is None:
            return self.d2h.submit(copy, what)

        def ordered() -> None:     # as a device stream waits on an event: later copies wait too
            after.wait()
            copy()
        return self.d2h.submit(ordered, what)

    def reduce(self, tensors, issue, what) -> Event:
        # The compute thread made the tensors before this call: nothing more to wait for.
        if self.network is None:
            self.network = ThreadStream("network", self.timeline)
        return self.network.submit(lambda: issue(tensors)(), what)

    def host_task(self, work: Callable[[], None], what: str) -> Event:
        return self.host.submit(work, what)

    def to_device(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        start = time.perf_counter()
        out = t.detach().clone(memory_format=torch.contiguous_format) if out is None else out.copy_(t)
        self.timeline.add("h2d", "inputs", start, time.perf_counter())
        return out

    def _streams(self) -> tuple[ThreadStream, ...]:
        return (self.h2d, self.d2h) + ((self.network,) if self.network is not None else ())

    def synchronize(self, host: bool = True) -> None:
        for s in self._streams() + ((self.host,) if host else ()):
            s.synchronize()

    def give_back_freed(self) -> None:
        # The simulated device's memory is host heap: it must not stay resident after the step
        # as a GPU's never is (runtime/host_heap.py).
        give_back_freed()

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def close(self) -> None:
        for s in self._streams() + (self.host,):
            s.close()


__all__ = ["CpuBackend"]
