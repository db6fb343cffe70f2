"""A host thread that runs work in order: the cpu backend's copy streams and the optimizer stream."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from .backend import Event, Timeline
from .delays import injected_delay
from ..optim.host_threads import host_threads


class ThreadEvent(Event):
    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def query(self) -> bool:
        return self._done.is_set()


def set_thread_intraop(threads: int) -> None:
    """Intra-op threads of the calling thread only. torch.set_num_threads would also change torch's
    process-wide default, which every thread started later (and the host optimizer's, through
    torch.get_num_threads()) then inherits; the OpenMP call below changes this thread's alone."""
    torch.get_num_threads()     # torch sets this thread's count once, lazily: let it happen first
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(threads)
    elif threads != torch.get_num_threads():
        torch.set_num_threads(threads)   # no OpenMP runtime found: torch's own call is the only one


def _openmp():
    import ctypes
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    return ctypes.CDLL(paths[0]) if paths else None


_here = threading.local()     # .stream: the ThreadStream whose thread this is, if any


def on_stream_thread() -> bool:
    """Whether the calling thread is a stream's (it must not wait for its own stream)."""
    return getattr(_here, "stream", None) is not None


class ThreadStream:
    """Work submitted here runs on one thread, in submission order; torch copies and math
    release the GIL, so it really runs beside the compute thread.

    `threads`: intra-op threads of that thread; None takes this rank's share of the machine's
    cores (host work: the optimizer, gradient accumulation; optim/host_threads.py), whatever
    OMP_NUM_THREADS the process was started with. `track`: the timeline stream its spans go on
    (default: its name)."""

    def __init__(self, name: str, timeline: Timeline, threads: int | None = 1, track: str | None = None):
        self.name, self.timeline, self.track = name, timeline, track or name
        self.threads = host_threads() if threads is None else threads
        self._queue: queue.Queue = queue.Queue()
        self._delay = injected_delay(name)   # None unless MEGACOMPILE_INJECT_DELAYS is set
        self._thread = threading.Thread(target=self._loop, name=f"megacompile-{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None], what: str) -> ThreadEvent:
        if not self._thread.is_alive():
            raise RuntimeError(f"the {self.name} stream is closed: no thread would run {what or 'this work'}")
        event = ThreadEvent()
        self._queue.put((work, what, event, self.timeline.tag()))
        return event

    def _loop(self) -> None:
        # A copy engine is one agent (threads=1): OpenMP teams on copy threads would fight the
        # compute thread's team for the cores (on a 2-core machine that tripled the step time of
        # small models). The host stream runs the optimizer on every core it is given.
        set_thread_intraop(self.threads)
        _here.stream = self
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, what, event, tag = item
            if self._delay is not None:
                self._delay()
            start = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the event
                event.set(e)
            else:
                event.set()
            if what:
                self.timeline.add(self.track, what, start, time.perf_counter(), tag)
            # The finished work must not stay referenced while the loop waits: its closure holds
            # the engine, which could then never be collected (and these threads never end).
            del item, work, event

    def synchronize(self) -> None:
        self.submit(lambda: None, "").wait()

    def close(self) -> None:
        """The queued work finishes, then the thread ends. Closing twice is harmless."""
        if self._thread.is_alive():
            self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
