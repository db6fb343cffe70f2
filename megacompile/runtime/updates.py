"""Host updates run most urgent first: the one the next forward needs soonest.

Gradients land in backward order, so a plain queue runs the updates last block first and the
prologue's last of all, while the next forward needs them the other way round: when the host lags,
the next step's first prefetch (the prologue's masters) waits for every update queued before it.
Each OPTIMIZER_STEP here registers its update and queues a job on the host stream; a job runs
whichever registered update comes first in (step, forward order), so updates still pending when the
backward ends run prologue first and the next forward overlaps the rest. Jobs and updates are one
to one, and a job always finds an update of its own step (its own at least), so clipping, which
runs before a step's updates on the same stream, still comes first.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .backend import Event, Timeline
from .stream import ThreadEvent


class UpdateQueue:
    def __init__(self, timeline: Timeline):
        self.timeline = timeline
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], tuple[list[Event], Callable[[], None], str, ThreadEvent]] = {}

    def register(self, step: int, stage: int, landed: list[Event], update: Callable[[], None], what: str) -> ThreadEvent:
        """Register one update (it runs after `landed`); returns the event its job sets when it ran."""
        done = ThreadEvent()
        with self._lock:
            self._pending[(step, stage)] = (landed, update, what, done)
        return done

    def run_most_urgent(self) -> None:
        """The body of one job on the host stream."""
        with self._lock:
            key = min(self._pending)
            landed, update, what, done = self._pending.pop(key)
        start = time.perf_counter()
        try:
            for event in landed:     # every gradient of these masters has been added in
                event.wait()
            update()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for these masters
            done.set(e)
        else:
            done.set()
        self.timeline.add("host", what, start, time.perf_counter())
