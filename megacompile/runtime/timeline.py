"""The measured record of the last step: when each node ran, on which stream, and the device bytes
live after it.

A span is tagged, when its work is handed to a stream, with the step it belongs to and the
schedule node that issued it (`node`, an index into the plan's nodes; None for work no node
issued). The executor calls `begin()` when a step starts: the record of the step before goes,
and the new one gathers this step's spans plus those of work from the step before that ends
during it (host AdamW updates run into the next forward; they keep their step's tag, so a reader
tells them apart). The record is a ring of at most `capacity` spans, so nothing grows without
bound between two `begin()` calls either.

Times are seconds of `time.perf_counter()`. On cuda, device work (a stage's kernels, a copy) is
timed with CUDA events: such a span holds its two events until read, and is placed on the host's
clock through the reference event recorded when the step began (`DeviceClock`). Reading the
record (`spans`, `on`) waits for those events.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Span:
    stream: str      # compute | h2d | d2h | host (a track of the trace)
    what: str        # e.g. "prefetch block.3"
    start: float     # seconds, time.perf_counter()
    end: float
    node: int | None = None    # the schedule node that issued it
    step: int = 0              # the Timeline step it was issued in


@dataclass
class MemorySample:
    node: int
    end: float         # when the node's issue on the compute thread ended
    live: int          # device bytes held after the node (the ledger's count)
    peak: int          # the most held while it ran


class DeviceClock:
    """Device time by events on the device's streams, placed on the host's clock.

    `event_type` makes an event with timing enabled (torch.cuda.Event); its `record(stream)`,
    `synchronize()` and `elapsed_time(other)` (milliseconds) are all this needs. The reference
    event is recorded when a step begins, at host time `host_at_reference`; a device event's time
    is that plus the milliseconds between them (the device may run behind the host, so the
    reference is where the host queued it, not where the device reached it)."""

    def __init__(self, event_type: Callable[[], Any]):
        self.event_type = event_type
        self.reference: Any = None
        self.host_at_reference = 0.0

    def mark(self, stream: Any) -> Any:
        event = self.event_type()
        event.record(stream)
        return event

    def begin(self, stream: Any, host_now: float) -> None:
        self.reference = self.mark(stream)
        self.host_at_reference = host_now

    def seconds(self, event: Any) -> float:
        event.synchronize()
        return self.host_at_reference + self.reference.elapsed_time(event) / 1e3


@dataclass
class _DeviceSpan:
    stream: str
    what: str
    begin: Any        # events, read through `clock` when the record is read
    end: Any
    clock: DeviceClock
    node: int | None
    step: int

    def resolve(self) -> Span:
        return Span(self.stream, self.what, self.clock.seconds(self.begin), self.clock.seconds(self.end),
                    self.node, self.step)


class Timeline:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self._spans: collections.deque = collections.deque(maxlen=capacity)
        self.memory: list[MemorySample] = []
        self.step = 0                  # counts begin() calls
        self.node: int | None = None   # the node the compute thread is issuing (set by the executor)
        self.program: Any = None       # the schedule the record belongs to
        self.started = 0.0             # host time the step began
        self._lock = threading.Lock()

    def begin(self, program: Any = None, now: float = 0.0) -> None:
        """A new step: the previous record goes."""
        with self._lock:
            self._spans.clear()
            self.memory = []
            self.step += 1
            self.node, self.program, self.started = None, program, now

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self.memory = []

    def tag(self) -> tuple[int | None, int]:
        """(node, step) for work handed to a stream now, from the thread that issues it."""
        return self.node, self.step

    def add(self, stream: str, what: str, start: float, end: float,
            tag: tuple[int | None, int] | None = None) -> None:
        node, step = self.tag() if tag is None else tag
        with self._lock:
            self._spans.append(Span(stream, what, start, end, node, step))

    def add_device(self, stream: str, what: str, begin: Any, end: Any, clock: DeviceClock) -> None:
        """A span timed by two device events (recorded around the work on its stream)."""
        node, step = self.tag()
        with self._lock:
            self._spans.append(_DeviceSpan(stream, what, begin, end, clock, node, step))

    def sample(self, node: int, end: float, live: int, peak: int) -> None:
        self.memory.append(MemorySample(node, end, live, peak))

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            items = list(self._spans)
        return [s.resolve() if isinstance(s, _DeviceSpan) else s for s in items]

    def on(self, stream: str) -> list[Span]:
        return [s for s in self.spans if s.stream == stream]
