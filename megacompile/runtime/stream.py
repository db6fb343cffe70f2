"""A host thread that runs work in order: the cpu backend's copy streams and the optimizer stream."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from .backend import Event, Timeline
from .delays import injected_delay


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


class ThreadStream:
    """Work submitted here runs on one thread, in submission order; torch copies and math
    release the GIL, so it really runs beside the compute thread."""

    def __init__(self, name: str, timeline: Timeline):
        self.name, self.timeline = name, timeline
        self._queue: queue.Queue = queue.Queue()
        self._delay = injected_delay(name)   # None unless MEGACOMPILE_INJECT_DELAYS is set
        self._thread = threading.Thread(target=self._loop, name=f"megacompile-{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None], what: str) -> ThreadEvent:
        if not self._thread.is_alive():
            raise RuntimeError(f"the {self.name} stream is closed: no thread would run {what or 'this work'}")
        event = ThreadEvent()
        self._queue.put((work, what, event))
        return event

    def _loop(self) -> None:
        # One intra-op thread here: a copy engine is one agent, and OpenMP teams on these
        # threads would fight the compute thread's team for the cores (on a 2-core machine that
        # tripled the step time of small models).
        torch.set_num_threads(1)
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, what, event = item
            if self._delay is not None:
                self._delay()
            start = time.perf_counter()
            try:
                work()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the event
                event.set(e)
            else:
                event.set()
            self.timeline.add(self.name, what, start, time.perf_counter())

    def synchronize(self) -> None:
        self.submit(lambda: None, "").wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
