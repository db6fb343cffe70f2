"""The runtime's timeline: one step's record, tagged by node, and device spans timed by CUDA events
(on a stubbed torch.cuda: the lines that time device work run here without a GPU)."""
from __future__ import annotations

import contextlib
import itertools

import torch

from megacompile.runtime import make_backend
from megacompile.runtime.timeline import Timeline
from tests.runtime.test_cuda_backend import GiB, fake_cuda  # noqa: F401 - the fixture


def test_a_new_step_drops_the_last_record_and_spans_keep_the_step_they_were_issued_in():
    timeline = Timeline()
    timeline.begin()
    timeline.node = 3
    timeline.add("h2d", "prefetch block.0", 1.0, 2.0)
    late = timeline.tag()                 # an update handed over in step 1, ending in step 2
    timeline.sample(3, 2.0, 100, 150)
    timeline.begin()
    timeline.add("host", "adamw block.0", 2.5, 3.0, late)
    timeline.node = 0
    timeline.add("compute", "forward block.0", 2.6, 2.9)
    assert [(s.what, s.node, s.step) for s in timeline.spans] == [("adamw block.0", 3, 1), ("forward block.0", 0, 2)]
    assert timeline.memory == [] and timeline.step == 2


def test_the_record_is_a_ring():
    timeline = Timeline(capacity=4)
    for i in range(10):
        timeline.add("compute", f"n{i}", i, i + 1)
    assert [s.what for s in timeline.spans] == ["n6", "n7", "n8", "n9"]


class _TimedEvent:
    """A CUDA event with timing: its device time is a tick of a clock shared by all, taken at record."""
    ticks = itertools.count()

    def __init__(self, enable_timing=False):
        self.timing, self.stream, self.at = enable_timing, None, None

    def record(self, stream):
        self.stream, self.at = stream, next(self.ticks) * 2.0     # milliseconds

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        assert self.timing and other.timing, "a device span needs events made with enable_timing=True"
        return other.at - self.at


def test_cuda_device_work_is_timed_by_events_on_its_stream(fake_cuda, monkeypatch):  # noqa: F811
    from megacompile.runtime.pinned_pool import PinnedPool
    compute = object()
    monkeypatch.setattr(torch.cuda, "Event", _TimedEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    backend = make_backend("cuda:1", 40 * GiB)
    waits = []
    try:
        backend.device = torch.device("cpu")
        backend.stash_pool = PinnedPool(lambda n, dtype: torch.empty(n, dtype=dtype))
        backend.h2d_stream = type("S", (), {"wait_event": lambda self, e: waits.append(e)})()
        backend.d2h_stream = type("S", (), {"wait_event": lambda self, e: waits.append(e)})()
        _TimedEvent.ticks = itertools.count()
        backend.begin_step()
        reference = backend.device_clock.reference
        assert reference.stream is compute
        backend.timeline.node = 4
        start = backend.clock()
        backend.compute_span("forward block.0", start)
        backend.timeline.node = 5
        backend.prefetch([torch.empty(3)], [torch.ones(3)], "prefetch block.1")
        backend.timeline.node = 6
        backend.offload([torch.ones(2)], lambda got: None, "stash saved1 of block.0", keep=True)
        spans = {s.stream: s for s in backend.timeline.spans}
    finally:
        backend.device = torch.device("cuda", 1)
        backend.close()
    assert set(spans) == {"compute", "h2d", "d2h"}
    assert [(spans[k].node, spans[k].step) for k in ("compute", "h2d", "d2h")] == [(4, 1), (5, 1), (6, 1)]
    # Ticks of 2 ms after the reference (0), placed on the host's clock where the step began:
    # compute 1-2; the prefetch's compute-side event 3, its copy 4-6 (the done event 5 between);
    # the stash's compute-side event 7, its copy 8-10.
    base = backend.timeline.started
    expected = {"compute": (2, 4), "h2d": (8, 12), "d2h": (16, 20)}
    for stream, (start, end) in expected.items():
        assert abs(spans[stream].start - (base + start / 1e3)) < 1e-9, stream
        assert abs(spans[stream].end - (base + end / 1e3)) < 1e-9, stream
    assert len(waits) == 2, "each copy waits for the compute stream before its first event"
