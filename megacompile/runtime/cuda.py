"""The `cuda` backend: the same runtime over torch.cuda streams, events and pinned staging.

Compute runs on the current stream of the engine's device; weights come in on an h2d stream and
gradients leave on a d2h stream, and the compute stream waits only on the copies it needs
(Event.wait is a stream-side wait, not a host sync). Every event is recorded on, and waited on
by, a stream of that one device, and the executor runs a step under `scope()`, so Triton kernels
launch there too: with device="cuda:1" nothing lands on cuda:0. Host memory that crosses the link
is pinned; the pinned buffers for gradients are pooled by shape and dtype, at exact size, and
those for stashed activations by size (runtime/pinned_pool.py).

Only device tensors cross the link: a saved bundle may hold host tensors (memory-efficient SDPA
returns its dropout philox seed and offset on the CPU); those are handed on as they are.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Callable

import torch

from ..errors import MegacompileError
from ..ir.printer import fmt_bytes, gib_within
from .allocator_conf import enable_expandable_segments
from .backend import Backend, Event, coalesce
from .page_locked import pinned_empty
from .pinned_pool import PinnedPool
from .stream import ThreadStream
from .timeline import DeviceClock


SMALL_OUTPUT_BYTES = 1 << 20


class CudaEvent(Event):
    def __init__(self, event: "torch.cuda.Event", device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class CopiedThenLanded(Event):
    """A gradient offload: wait() is stream-side, for the copy alone (after it the device tensors
    may be freed); `landed` is the host work after it (the add into the fp32 grads), waited for by
    what reads its result, the optimizer step on the host stream, not by the compute thread."""

    def __init__(self, copied: CudaEvent, landed):
        self.copied, self.landed = copied, landed

    def wait(self) -> None:
        self.copied.wait()


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, budget_bytes: int, device: torch.device):
        if device.type != "cuda" or device.index is None:
            raise MegacompileError(f"the cuda backend needs a device with its index (runtime.normalize_device), "
                                   f"got {device}")
        total = torch.cuda.get_device_properties(device).total_memory
        if budget_bytes > total:
            raise MegacompileError(
                f"hbm_budget of {budget_bytes / 2**30:.4g} GiB ({fmt_bytes(budget_bytes)}) is more than {device} has "
                f"({total / 2**30:.4g} GiB, {fmt_bytes(total)}); lower hbm_budget to at most {gib_within(total)}")
        super().__init__(budget_bytes)
        self.device = device
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.network_stream = None     # collectives (data parallelism), made at the first
        # The host side of offloads: it adds landed gradients into the fp32 grads, host math.
        self.d2h = ThreadStream("d2h", self.timeline, threads=None, track="d2h host side")
        self.host = ThreadStream("host", self.timeline, threads=None)   # the optimizer, on every core
        self._staging: dict[tuple, list[torch.Tensor]] = {}
        self.stash_pool = PinnedPool()    # host copies of stashed activations, at exact size
        self._outputs: list = []      # copy-done events of outputs on their way to the host
        # The timeline's device spans: CUDA events with timing, around each stage's kernels and copy.
        self.device_clock = DeviceClock(lambda: torch.cuda.Event(enable_timing=True))
        # The caching allocator refuses past the budget too: a second, independent guard. The
        # plan fills only budget - reserve (cost/reserve.py), so the cap sits above the ledger's
        # peak by what the ledger cannot see (workspaces, op scratch, fragmentation). The cap is
        # process-wide: close() gives back the one that was there before.
        self._fraction_before = _memory_fraction(self.device)
        torch.cuda.set_per_process_memory_fraction(budget_bytes / total, self.device)
        self.allocator_conf = enable_expandable_segments()
        # cudaMalloc retries (the allocator hit the cap, freed its cache and tried again: a stall
        # each time; the goal is none), counted from here and from the start of the last run.
        self._retries_at_open = self._retries_at_run = _alloc_retries(self.device)

    def scope(self) -> AbstractContextManager:
        return torch.cuda.device(self.device)

    def begin_step(self, program=None) -> None:
        super().begin_step(program)
        self.device_clock.begin(self._compute_stream(), self.timeline.started)

    def clock(self):
        return self.device_clock.mark(self._compute_stream())

    def compute_span(self, what: str, start) -> None:
        self.timeline.add_device("compute", what, start, self.clock(), self.device_clock)

    def _compute_stream(self) -> "torch.cuda.Stream":
        return torch.cuda.current_stream(self.device)

    def _event_on(self, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def arena_storage(self, arena: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
        # The CUDA array interface makes a tensor over the pointer without copying; its storage is
        # not the caching allocator's (record_stream skips it), and keeps `arena` alive.
        return torch.as_tensor(_DeviceBytes(arena, offset, nbytes), device=self.device)

    def give_back_arena(self) -> None:
        torch.cuda.empty_cache()

    def prefetch(self, dsts, srcs, what) -> Event:
        ready = self._event_on(self._compute_stream())    # the slot was allocated on the compute stream
        with torch.cuda.stream(self.h2d_stream):
            self.h2d_stream.wait_event(ready)
            begun = self.device_clock.mark(self.h2d_stream)
            for d, s in coalesce(dsts, srcs):
                # No record_stream: the compute stream waits on `done` before it reads or frees
                # the slot, so the allocator's compute-stream order already covers this copy.
                d.copy_(s, non_blocking=True)
            done = self._event_on(self.h2d_stream)
            self.timeline.add_device("h2d", what, begun, self.device_clock.mark(self.h2d_stream), self.device_clock)
        return CudaEvent(done, self.device)

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        # Registered at its exact size (page_locked.pinned_empty): torch's pinned allocator would round
        # each staging buffer up to a power of two and keep it.
        pool = self._staging.setdefault((tuple(t.shape), t.dtype), [])
        return pool.pop() if pool else pinned_empty(t.numel(), t.dtype).view(t.shape)

    def reduce(self, tensors, issue, what) -> Event:
        """NCCL collectives are issued with this stream current: the process group's own stream
        waits on it, so on the gradients' producer; the works' wait() makes it wait on NCCL's
        stream, so what `issue` queues after (the division) and the copies ordered behind the
        returned event see the sums. Nothing here blocks the host."""
        if self.network_stream is None:
            self.network_stream = torch.cuda.Stream(self.device)
        produced = self._event_on(self._compute_stream())
        with torch.cuda.stream(self.network_stream):
            self.network_stream.wait_event(produced)
            begun = self.device_clock.mark(self.network_stream)
            for t in tensors:
                t.record_stream(self.network_stream)   # the compute stream frees them after the offload's copy
            issue(tensors)()
            done = self._event_on(self.network_stream)
            self.timeline.add_device("network", what, begun, self.device_clock.mark(self.network_stream),
                                     self.device_clock)
        return CudaEvent(done, self.device)

    def offload(self, srcs, sink: Callable[[list[torch.Tensor]], None], what, keep: bool = False,
                dsts=None, after: Event | None = None) -> Event:
        # No record_stream on the sources: the schedule frees an offloaded value only after a WAIT
        # on its copy (ir/verify.py refuses any other order), and that WAIT is a compute-stream
        # wait on `done`, so the allocator's compute-stream order already puts any reuse of the
        # sources' blocks after the copy. record_stream would instead hold each block until the
        # allocator sees the copy finish, hundreds of GiB a step at 14B, behind pending copies.
        produced = self._event_on(self._compute_stream())
        pooled = []
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(produced)
            if after is not None:          # the reduced gradients: copied once the collective is done
                self.d2h_stream.wait_event(after.event)
            begun = self.device_clock.mark(self.d2h_stream)
            staged = []
            for s, dst in zip(srcs, dsts if dsts is not None else [None] * len(srcs)):
                if s.device != self.device:
                    staged.append(s)        # already on the host (an SDPA philox seed): handed on as is
                    continue
                if dst is not None:         # straight into its final (page-locked) buffer
                    h = dst
                elif keep:
                    h, read_before = self.stash_pool.take(s)
                    if read_before is not None:     # the buffer's last restore may still read it
                        self.d2h_stream.wait_event(read_before)
                else:
                    h = self._pinned(s)
                    pooled.append(h)
                h.copy_(s, non_blocking=True)
                staged.append(h)
            done = self._event_on(self.d2h_stream)
            self.timeline.add_device("d2h", what, begun, self.device_clock.mark(self.d2h_stream), self.device_clock)
        if keep:
            # Stashed activations are read only by the device: a restore copies them back on the
            # h2d stream after a compute-stream wait on `done`. So the sink takes the buffers now
            # and the wait is stream-side; no host thread waits for the copy.
            sink(staged)
            return CudaEvent(done, self.device)

        def land() -> None:
            done.synchronize()
            sink(staged)
            for h in pooled:
                self._staging[(tuple(h.shape), h.dtype)].append(h)
        return CopiedThenLanded(CudaEvent(done, self.device), self.d2h.submit(land, what))

    def release_stash(self, host, after: Event | None) -> None:
        # Free for the next stash once the restore's copy (`after`, on the h2d stream) has read them.
        self.stash_pool.give_back(host, None if after is None else after.event)

    def host_task(self, work: Callable[[], None], what: str) -> Event:
        return self.host.submit(work, what)

    def to_device(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        start = time.perf_counter()
        out = t.to(self.device, non_blocking=False) if out is None else out.copy_(t, non_blocking=False)
        self.timeline.add("h2d", "inputs", start, time.perf_counter())
        return out

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        # Queued on the compute stream: the loss comes back without stalling the step mid-way.
        # A small output (the loss) comes from torch's caching pinned allocator: registering a
        # fresh page-locked buffer costs milliseconds, every step.
        small = t.numel() * t.element_size() <= SMALL_OUTPUT_BYTES
        out = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if small
               else pinned_empty(t.numel(), t.dtype).view(t.shape))
        out.copy_(t.detach(), non_blocking=True)
        self._outputs.append(self._event_on(self._compute_stream()))
        return out

    def synchronize(self, host: bool = True) -> None:
        """The end of a step: the outputs' copies and the gradients' host side (which waited for
        their copies, so for the backward). Device work may still run; the caching allocator
        orders reuse on the streams. After an error (host=True) the whole device is drained."""
        for event in self._outputs:
            event.synchronize()
        self._outputs.clear()
        self.d2h.synchronize()
        if host:
            torch.cuda.synchronize(self.device)
            self.host.synchronize()

    def allocator_stats(self) -> dict:
        retries = _alloc_retries(self.device)
        return {"allocator_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "allocator_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device),
                "allocator_alloc_retries": retries - self._retries_at_run,
                "allocator_alloc_retries_total": retries - self._retries_at_open,
                "allocator_conf": self.allocator_conf,
                "host_stash_pinned_bytes": self.stash_pool.allocated_bytes}

    def reset_allocator_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._retries_at_run = _alloc_retries(self.device)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def close(self) -> None:
        self.d2h.close()
        self.host.close()
        torch.cuda.set_per_process_memory_fraction(self._fraction_before, self.device)


class _DeviceBytes:
    """Bytes [offset, offset + nbytes) of a device tensor, as the CUDA array interface describes them."""

    def __init__(self, arena: torch.Tensor, offset: int, nbytes: int):
        self.arena = arena
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None, "version": 3,
                                         "data": (arena.data_ptr() + offset, False)}


def _alloc_retries(device: torch.device) -> int:
    # torch.cuda.memory_stats()["num_alloc_retries"] counts since the process began (a reset of
    # the peaks leaves it), so the backend reports differences.
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _memory_fraction(device: torch.device) -> float:
    # torch.cuda.get_per_process_memory_fraction is recent; without it the cap was never set (1.0).
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return get(device) if get is not None else 1.0
