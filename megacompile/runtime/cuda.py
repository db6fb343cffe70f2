"""The `cuda` backend: the same runtime over torch.cuda streams, events and pinned staging.

Compute runs on the current stream; weights come in on an h2d stream and gradients leave on a
d2h stream, and the compute stream waits only on the copies it needs (Event.wait is a
stream-side wait, not a host sync). Host memory that crosses the link is pinned; the pinned
buffers for gradients are pooled by shape and dtype, at exact size.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from .backend import Backend, Event, dense_like
from .stream import ThreadStream


class CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class HostAfterDevice(Event):
    """Host work that ran after a device copy; waiting means both are done."""

    def __init__(self, done):
        self.done = done

    def wait(self) -> None:
        self.done.wait()


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, budget_bytes: int, device: torch.device | None = None):
        super().__init__(budget_bytes)
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.d2h = ThreadStream("d2h", self.timeline)     # host side of offloads
        self.host = ThreadStream("host", self.timeline)   # the optimizer
        self._staging: dict[tuple, list[torch.Tensor]] = {}
        total = torch.cuda.get_device_properties(self.device).total_memory
        # The caching allocator refuses past the budget too: a second, independent guard.
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total), self.device)

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def prefetch(self, dsts, srcs, what) -> Event:
        ready = torch.cuda.Event()
        ready.record()                      # the slot was allocated on the compute stream
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(ready)
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
                d.record_stream(self.h2d_stream)
            done = torch.cuda.Event()
            done.record()
        return CudaEvent(done)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        pool = self._staging.setdefault((tuple(t.shape), t.dtype), [])
        return pool.pop() if pool else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

    def offload(self, srcs, sink: Callable[[list[torch.Tensor]], None], what, keep: bool = False) -> Event:
        produced = torch.cuda.Event()
        produced.record()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(produced)
            staged = []
            for s in srcs:
                h = dense_like(s, pin=True) if keep else self._pinned(s)
                h.copy_(s, non_blocking=True)
                s.record_stream(self.d2h_stream)
                staged.append(h)
            done = torch.cuda.Event()
            done.record()

        def land() -> None:
            done.synchronize()
            sink(staged)
            if not keep:
                for h in staged:
                    self._staging[(tuple(h.shape), h.dtype)].append(h)
        return HostAfterDevice(self.d2h.submit(land, what))

    def host_task(self, work: Callable[[], None], what: str) -> Event:
        return self.host.submit(work, what)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = t.to(self.device, non_blocking=False)
        self.timeline.add("h2d", "inputs", start, time.perf_counter())
        return out

    def synchronize(self, host: bool = True) -> None:
        torch.cuda.synchronize(self.device)
        self.d2h.synchronize()
        if host:
            self.host.synchronize()

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def close(self) -> None:
        self.d2h.close()
        self.host.close()
