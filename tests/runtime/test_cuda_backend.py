"""The cuda backend's setup and the runtime's handling of host tensors, on a stubbed torch.cuda:
what can break before the first kernel runs is checked here, without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megacompile.errors import MegacompileError
from megacompile.runtime import make_backend, normalize_device
from megacompile.runtime.executor import Executor
from megacompile.runtime.host import register_host

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
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: calls.streams.append(device) or SimpleNamespace())
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
        self.offloaded, self.restored = [], []
        self.memory = SimpleNamespace(hold=lambda *a, **k: None, drop=lambda *a, **k: None)

    def offload(self, srcs, sink, what, keep=False):
        self.offloaded = list(srcs)
        sink([torch.empty(t.shape, dtype=t.dtype) if t.device == self.device else t for t in srcs])
        return SimpleNamespace(wait=lambda: None)

    def prefetch(self, dsts, srcs, what):
        self.restored = list(zip(dsts, srcs))
        return SimpleNamespace(wait=lambda: None)


def test_stashed_activations_move_only_their_device_tensors():
    """Memory-efficient SDPA with dropout returns its philox seed and offset as CPU tensors in the
    saved bundle: they stay where they are, and the bundle comes back in its order."""
    backend = _StubBackend()
    program = SimpleNamespace(values={"saved.0": SimpleNamespace(kind="saved")}, stage_names=["block.0"], nodes=[])
    executor = Executor(None, program, backend, None)
    seed, offset = torch.tensor(7), torch.tensor(3)
    act = torch.empty(4, 8, device="meta")
    executor._env["saved.0"] = [act, seed, offset]
    executor._stash_saved(SimpleNamespace(stage=0, reads=["saved.0"]))
    executor._restore(SimpleNamespace(stage=0, writes=["saved.0"]))
    bundle = executor._env["saved.0"]
    assert bundle[1] is seed and bundle[2] is offset
    assert bundle[0].device.type == "meta" and bundle[0].shape == act.shape
    assert [s.device.type for s in backend.offloaded if s.device.type != "meta"] == ["cpu", "cpu"]
    assert len(backend.restored) == 1 and backend.restored[0][0] is bundle[0]


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


def test_the_fp32_master_is_page_locked_only_when_the_device_reads_it(monkeypatch):
    from megacompile.runtime import host
    pinned = []
    monkeypatch.setattr(host, "pinned_empty", lambda n, dtype: pinned.append(dtype) or torch.empty(n, dtype=dtype))
    host.OwnerBuffers(8, torch.bfloat16, pin=True)
    assert pinned == [torch.bfloat16]
    pinned.clear()
    buffers = host.OwnerBuffers(8, torch.float32, pin=True)
    assert pinned == [torch.float32] and buffers.compute is buffers.master


def test_an_update_waits_on_the_host_for_every_gradient_of_its_masters():
    """With stream-side gradient WAITs the compute thread never blocks on the host's add of a
    gradient; the update of those masters must then wait for it on the host stream."""
    import threading

    from megacompile.runtime.backend import Timeline
    from megacompile.runtime.stream import ThreadEvent, ThreadStream
    host_stream = ThreadStream("host", Timeline())
    backend = SimpleNamespace(host_task=host_stream.submit, memory=None)
    seen = []
    program = SimpleNamespace(stage_names=["prologue", "block.0", "epilogue"], nodes=[])
    host = SimpleNamespace(contributors={0: {0, 2}}, pending={})
    executor = Executor(None, program, backend, host, update=lambda s, c: seen.append([e.query() for e in landed]))
    landed = [ThreadEvent(), ThreadEvent()]
    executor._landed = {0: landed[0], 1: ThreadEvent(), 2: landed[1]}   # stage 1's gradients feed another owner
    executor._optimizer_step(SimpleNamespace(stage=0))
    timers = [threading.Timer(0.05 * (i + 1), e.set) for i, e in enumerate(landed)]
    for t in timers:
        t.start()
    host.pending[0].wait()
    host_stream.close()
    assert seen == [[True, True]]
