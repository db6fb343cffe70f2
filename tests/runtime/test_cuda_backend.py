"""The cuda backend's setup and the runtime's handling of host tensors, on a stubbed torch.cuda:
what can break before the first kernel runs is checked here, without a GPU."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megacompile.errors import MegacompileError
from megacompile.runtime import make_backend, normalize_device
from megacompile.runtime.executor import Executor
from megacompile.runtime.page_locked import register_host

GiB = 2 ** 30


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two 80 GiB GPUs, cuda:1 current; records the calls the backend makes."""
    calls = SimpleNamespace(fraction=[], streams=[])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GiB))

    def fraction(f, device):
        # torch refuses a device without an index here ("Expected a cuda device with a specified index")
        if torch.device(device).index is None:
            raise ValueError("Expected a cuda device with a specified index")
        calls.fraction.append((f, torch.device(device)))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fraction)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.75, raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: calls.streams.append(device) or SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: None, raising=False)
    return calls


@pytest.mark.parametrize("asked, expected", [(None, "cuda:1"), ("cuda", "cuda:1"), (torch.device("cuda"), "cuda:1"),
                                             ("cuda:0", "cuda:0"), ("cpu", "cpu")])
def test_the_device_is_normalised_to_one_with_an_index(fake_cuda, asked, expected):
    assert normalize_device(asked) == torch.device(expected)


def test_a_missing_gpu_index_is_named(fake_cuda):
    with pytest.raises(MegacompileError, match="cuda:5 does not exist.*2 GPU"):
        normalize_device("cuda:5")


def test_the_cuda_backend_is_made_for_the_current_gpu_with_its_index(fake_cuda):
    backend = make_backend("cuda", 40 * GiB)
    try:
        assert backend.device == torch.device("cuda", 1)
        assert fake_cuda.fraction == [(0.5, torch.device("cuda", 1))]
        assert fake_cuda.streams == [torch.device("cuda", 1)] * 2
    finally:
        backend.close()
    # The cap is process-wide: once the engine is closed the one from before is back.
    assert fake_cuda.fraction[-1] == (0.75, torch.device("cuda", 1))


def test_a_budget_above_the_device_memory_is_refused(fake_cuda):
    with pytest.raises(MegacompileError, match="hbm_budget of 96 GiB .* more than cuda:1 has .*80 GiB"):
        make_backend("cuda:1", 96 * GiB)
    assert fake_cuda.fraction == [] and fake_cuda.streams == [], "nothing is set up for a refused budget"


def test_a_failed_host_registration_clears_cuda_error_state():
    calls = []
    cudart = SimpleNamespace(cudaHostRegister=lambda ptr, size, flags: calls.append("register") or 1,
                             cudaGetLastError=lambda: calls.append("clear") or 0,
                             cudaHostUnregister=lambda ptr: calls.append("unregister"))
    original = torch.cuda.cudart
    torch.cuda.cudart = lambda: cudart
    try:
        assert register_host(torch.empty(16)) is False
    finally:
        torch.cuda.cudart = original
    assert calls == ["register", "clear"]


class _StubBackend:
    """Device tensors live on `meta`; records what each copy was asked to move."""
    device = torch.device("meta")

    def __init__(self):
        from megacompile.runtime.backend import Timeline
        self.timeline = Timeline()
        self.offloaded, self.restored = [], []
        self.memory = SimpleNamespace(hold=lambda *a, **k: None, drop=lambda *a, **k: None)

    def offload(self, srcs, sink, what, keep=False, dsts=None):
        self.offloaded = list(srcs)
        sink([torch.empty(t.shape, dtype=t.dtype) if t.device == self.device else t for t in srcs])
        return SimpleNamespace(wait=lambda: None)

    def prefetch(self, dsts, srcs, what):
        self.restored = list(zip(dsts, srcs))
        return SimpleNamespace(wait=lambda: None)

    def empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, device=self.device)

    def release_stash(self, host, after):
        pass


def test_stashed_activations_move_only_their_device_tensors():
    """Memory-efficient SDPA with dropout returns its philox seed and offset as CPU tensors in the
    saved bundle: they stay where they are, and the bundle comes back in its order."""
    backend = _StubBackend()
    program = SimpleNamespace(values={"saved.0": SimpleNamespace(kind="saved"), "hsaved.0": SimpleNamespace(kind="saved")},
                              stage_names=["block.0"], nodes=[])
    executor = Executor(None, program, backend, None)
    seed, offset = torch.tensor(7), torch.tensor(3)
    act = torch.empty(4, 8, device="meta")
    executor._env["saved.0"] = [act, seed, offset]
    executor._stash_saved(SimpleNamespace(stage=0, reads=["saved.0"]))
    executor._restore(SimpleNamespace(stage=0, writes=["hsaved.0"]))     # comes back as h<name>
    bundle = executor._env["hsaved.0"]
    assert bundle[1] is seed and bundle[2] is offset
    assert bundle[0].device.type == "meta" and bundle[0].shape == act.shape and bundle[0].stride() == act.stride()
    # Only the device storage crosses, once, as flat bytes; the bundle is rebuilt on what came back.
    assert [(s.device.type, s.dtype, s.numel()) for s in backend.offloaded] == [("meta", torch.uint8, 4 * 8 * 4)]
    assert len(backend.restored) == 1 and backend.restored[0][0].numel() == 4 * 8 * 4


def test_a_stage_slot_is_one_buffer_per_dtype_and_its_copies_coalesce():
    from megacompile.capture.stage import TensorMeta
    from megacompile.runtime.backend import coalesce, flat_empty
    backend = SimpleNamespace(empty=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    metas = [TensorMeta((4, 3), torch.bfloat16), TensorMeta((3,), torch.bfloat16), TensorMeta((2,), torch.int64),
             TensorMeta((5,), torch.bfloat16)]
    slot = flat_empty(backend, metas)
    assert [tuple(t.shape) for t in slot] == [(4, 3), (3,), (2,), (5,)]
    assert len({t.untyped_storage().data_ptr() for t in slot}) == 2
    host = torch.arange(20, dtype=torch.bfloat16)               # an owner's flat compute buffer
    srcs = [host[0:12].view(4, 3), host[12:15], torch.tensor([7, 8]), host[15:20]]
    pairs = coalesce(slot, srcs)
    # bf16 parameters 0, 1 are back to back on both sides; the int buffer breaks the run
    assert [d.numel() for d, _ in pairs] == [15, 2, 5]
    for d, s in pairs:
        d.copy_(s)
    for d, s in zip(slot, srcs):
        assert torch.equal(d, s)
    # a source that is not next to the previous one starts a new copy
    assert len(coalesce(slot[:2], [host[0:12].view(4, 3), host[13:16]])) == 2


def test_only_what_crosses_the_link_is_page_locked(monkeypatch):
    """The compute copy the device fetches (bf16 gradients land in it), the fp32 master only when
    the device reads it itself, and then its gradient buffer, which the device's gradients land in."""
    from megacompile.cost.host_memory import Placement, owner_layout
    from megacompile.runtime import host
    pinned = []
    monkeypatch.setattr(host, "pinned_empty", lambda n, dtype: pinned.append(dtype) or torch.empty(n, dtype=dtype))
    buffers = host.OwnerBuffers(8, torch.bfloat16, pin=True)
    assert pinned == [torch.bfloat16] and buffers.grad is buffers.compute
    pinned.clear()
    buffers = host.OwnerBuffers(8, torch.float32, pin=True)
    assert pinned == [torch.float32, torch.float32] and buffers.compute is buffers.master   # master, grad
    pinned.clear()
    # sums of micro-batches, and a tied owner's fp32 sum beside bf16 compute, stay pageable
    host.OwnerBuffers(8, torch.bfloat16, pin=True, layout=owner_layout(torch.bfloat16, 2, False, Placement()))
    host.OwnerBuffers(8, torch.bfloat16, pin=True, layout=owner_layout(torch.bfloat16, 1, True, Placement()))
    assert pinned == [torch.bfloat16, torch.bfloat16]


def test_a_step_ends_only_once_every_gradient_is_added_on_the_host():
    """With stream-side gradient WAITs the compute thread never blocks on the host's add of a
    gradient; the end of the walk waits for every one, so the finiteness check and the commit of
    the updates see all of them."""
    import threading

    from megacompile.runtime.backend import Timeline
    from megacompile.runtime.stream import ThreadEvent
    memory = SimpleNamespace(reset_peak=lambda: None, drop=lambda *a: None,
                             ledger=SimpleNamespace(snapshot=lambda: None, restore=lambda held: None,
                                                    live_bytes=0, peak_bytes=0))
    timeline = Timeline()
    backend = SimpleNamespace(memory=memory, timeline=timeline, reset_allocator_peak=lambda: None,
                              scope=contextlib.nullcontext, synchronize=lambda host: None,
                              begin_step=timeline.begin, give_back_freed=lambda: None)
    program = SimpleNamespace(stage_names=["block.0"], nodes=[SimpleNamespace(op=SimpleNamespace(value="offload_mark"), stream="d2h")])
    executor = Executor(None, program, backend, SimpleNamespace(pending={}))
    landed = ThreadEvent()
    executor._offload_mark = lambda node: executor._landed.__setitem__(0, landed)
    timer = threading.Timer(0.05, landed.set)
    timer.start()
    executor.run([])
    assert landed.query()
    timer.join()


class _FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.stream = None

    def record(self, stream):
        self.stream = stream

    def synchronize(self):
        raise AssertionError("a host thread waited for a device copy")


def test_a_stash_is_waited_for_on_the_compute_stream_not_on_a_host_thread(fake_cuda, monkeypatch):
    """Stashed activations go to host memory for the device alone to read back: the executor gets
    them at once, and its WAIT orders the compute stream after the copy without blocking a thread."""
    from megacompile.runtime.pinned_pool import PinnedPool
    compute = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    backend = make_backend("cuda:1", 40 * GiB)
    try:
        backend.stash_pool = PinnedPool(lambda n, dtype: torch.empty(n, dtype=dtype))
        backend.device = torch.device("cpu")          # host tensors stand for device ones here
        backend.d2h_stream = _FakeStream()
        got = []
        event = backend.offload([torch.ones(3), torch.zeros(2)], got.append, "stash block.0", keep=True)
        assert len(got) == 1 and [t.shape for t in got[0]] == [(3,), (2,)], "the sink has the buffers at once"
        assert torch.equal(got[0][0], torch.ones(3))
        event.wait()
        assert compute.waited == [event.event] and event.event.stream is backend.d2h_stream
    finally:
        backend.device = torch.device("cuda", 1)
        backend.close()


def test_an_open_cuda_backend_is_drained_and_closed_at_exit(fake_cuda, monkeypatch):
    # At interpreter exit (runtime/shutdown.py) the host work still queued runs to its end, the
    # threads stop and the allocator cap from before comes back.
    from megacompile.runtime import shutdown
    drained = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: drained.append(device))
    backend = make_backend("cuda", 40 * GiB)
    shutdown.watch(backend)
    threads = [backend.d2h._thread, backend.host._thread]
    ran = []
    backend.host_task(lambda: ran.append("update"), "update")
    shutdown.end_all()
    assert ran == ["update"]
    assert not any(t.is_alive() for t in threads)
    assert fake_cuda.fraction[-1] == (0.75, torch.device("cuda", 1))
    assert drained == [torch.device("cuda", 1)]      # the device's own queue too
    shutdown.end(backend)                               # once only
    assert drained == [torch.device("cuda", 1)]
