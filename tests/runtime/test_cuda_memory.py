"""The cuda backend's memory at scale, on a stand-in torch.cuda (tests/runtime/fake_gpu.py): the
stash in exact-size page-locked buffers reused step to step, offload sources freed behind a
compute-stream wait instead of record_stream, the allocator's retries reported, and expandable
segments turned on unless the user configured the allocator."""
from __future__ import annotations

import pytest
import torch

import megacompile.planner.search as planner
from megacompile.acceptance.parity import AdamW, BETAS, EPS, LR, WD, clone, eager_losses, make_inputs
from megacompile.ir.program import Op
from megacompile.passes import ScheduleChoice
from megacompile.runtime.pinned_pool import PinnedPool
from tests import models
from tests.runtime.fake_gpu import FakeEvent, FakeGpu, GiB


@pytest.fixture
def gpu(monkeypatch):
    return FakeGpu().install(monkeypatch)


def _train_on_fake_gpu(gpu, monkeypatch, model, batches):
    """The engine on the cuda backend (device tensors on the host), with the first two blocks'
    saved activations stashed: every step, the log of stream work and of device frees."""
    import megacompile
    from megacompile.engine import engine as engine_module
    from megacompile.runtime import cuda
    forced = lambda blocks, *a, **k: (ScheduleChoice(1, frozenset(blocks[2:3]), offload=frozenset(blocks[:2]),  # noqa: E731
                                                     offload_lag=2), 0)
    monkeypatch.setattr(planner, "solve", forced)
    monkeypatch.setattr(engine_module, "make_backend", lambda device, budget: gpu.backend(budget))
    monkeypatch.setattr(cuda, "SMALL_OUTPUT_BYTES", -1)     # the loss too in a registered buffer
    engine = megacompile.compile(model, hbm_budget=1.0, device="cuda", fuse=False,
                                 optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))
    backend = engine.backend
    offload, drop = backend.offload, backend.memory.drop
    sources: dict[int, list[int]] = {}      # event id of an offload's copy -> its device sources

    def logged_offload(srcs, *a, **k):
        event = offload(srcs, *a, **k)
        done = getattr(event, "copied", event).event
        sources[done.id] = [t.data_ptr() for t in srcs if t.device == backend.device]
        return event

    def logged_drop(name, value):
        tensors = value if isinstance(value, (list, tuple)) else [value]
        gpu.log.append(("free", name, [t.data_ptr() for t in tensors if isinstance(t, torch.Tensor)]))
        return drop(name, value)
    monkeypatch.setattr(backend, "offload", logged_offload)
    monkeypatch.setattr(backend.memory, "drop", logged_drop)
    losses, pool_bytes = [], []
    try:
        for ids in batches:
            losses.append(engine.step(**make_inputs("nanogpt", ids)))
            pool_bytes.append((backend.stash_pool.allocated_bytes, backend.stash_pool.lent_bytes))
        engine.synchronize()
    except BaseException:
        engine.close()      # its threads and exit hook would outlive the stand-in torch.cuda
        raise
    return engine, losses, pool_bytes, sources


def test_the_stash_is_held_at_the_plans_figure_and_sources_freed_after_a_stream_wait(gpu, monkeypatch):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(3)]
    reference = clone(model)
    expected = eager_losses(reference, batches, "nanogpt")
    engine, losses, pool_bytes, sources = _train_on_fake_gpu(gpu, monkeypatch, clone(model), batches)
    try:
        plan = engine.plan
        assert [n.stage for n in plan.program.nodes if n.op is Op.OFFLOAD and n.reads[0].startswith("saved")] == [1, 2]
        # The cuda backend's own code trains exactly as eager torch does.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        # Page-locked bytes for the stash: the plan's figure exactly (no power-of-two rounding),
        # allocated in the first step and reused after it; nothing stays lent between steps.
        assert plan.stash_bytes > 0
        assert pool_bytes == [(plan.stash_bytes, 0)] * len(batches)
        assert engine.memory_stats()["host_stash_pinned_bytes"] == plan.stash_bytes
        # No offload source is held by record_stream ...
        assert not [e for e in gpu.log if e[0] == "record_stream"]
        # ... because the compute stream waited on each copy before the source was freed.
        assert sources
        for done, ptrs in sources.items():
            recorded = gpu.log.index(("record", "side1", done))          # d2h is the second side stream
            waited = gpu.log.index(("wait", "compute", done))
            freed = next(i for i, e in enumerate(gpu.log) if i > recorded and e[0] == "free" and set(ptrs) & set(e[2]))
            assert recorded < waited < freed, f"an offload's source was freed before the compute stream waited for its copy"
    finally:
        engine.close()


def test_a_stash_buffer_is_reused_only_after_the_restore_that_reads_it(gpu):
    """The d2h copy into a pooled buffer waits (stream-side) on the h2d copy that last read it."""
    backend = gpu.backend(40 * GiB)
    try:
        act = torch.randn(3, 5)
        got = []
        backend.offload([act], got.append, "stash", keep=True)
        (host,) = got[0]
        assert torch.equal(host, act)
        restored = torch.empty_like(act)
        event = backend.prefetch([restored], [host], "restore")
        backend.release_stash([host], event)
        mark = len(gpu.log)
        backend.offload([act.t()], got.append, "stash", keep=True)      # same bytes, a transposed layout
        (again,) = got[1]
        assert again.data_ptr() == host.data_ptr() and again.stride() == act.t().stride()
        assert ("wait", "side1", event.event.id) in gpu.log[mark:]
        assert backend.stash_pool.allocated_bytes == act.numel() * act.element_size()
    finally:
        backend.close()


def test_the_pool_allocates_exact_sizes_and_reuses_by_size():
    allocated = []
    pool = PinnedPool(lambda n, dtype: allocated.append(n) or torch.empty(n, dtype=dtype))
    a, pending = pool.take(torch.empty(1000, 3, dtype=torch.bfloat16))
    b, _ = pool.take(torch.empty(7, dtype=torch.float32))
    assert pending is None and allocated == [6000, 28] and pool.allocated_bytes == 6028 == pool.lent_bytes
    marker = FakeEvent([])
    pool.give_back([a], marker)
    c, pending = pool.take(torch.empty(3000, dtype=torch.float16))     # same bytes, another dtype
    assert pending is marker and c.data_ptr() == a.data_ptr() and allocated == [6000, 28]
    d, pending = pool.take(torch.empty(1000, 3, dtype=torch.bfloat16))  # none free: a new one
    assert pending is None and allocated == [6000, 28, 6000]
    pool.give_back([torch.empty(4)])                                   # not the pool's: ignored
    assert pool.lent_bytes == 6000 + 28 + 6000


def test_alloc_retries_are_reported_per_run_and_since_open(gpu):
    backend = gpu.backend(40 * GiB)
    try:
        gpu.retries = 5
        backend.reset_allocator_peak()          # a run begins
        gpu.retries = 7
        stats = backend.allocator_stats()
        assert stats["allocator_alloc_retries"] == 2 and stats["allocator_alloc_retries_total"] == 7
    finally:
        backend.close()


def test_expandable_segments_are_turned_on_unless_the_user_configured_the_allocator(gpu, monkeypatch):
    backend = gpu.backend(40 * GiB)
    backend.close()
    assert gpu.settings == ["expandable_segments:True"]
    assert backend.allocator_stats()["allocator_conf"] == "expandable_segments:True (set by megacompile)"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    backend = gpu.backend(40 * GiB)
    backend.close()
    assert gpu.settings == ["expandable_segments:True"], "the user's configuration is left alone"
    assert backend.allocator_conf == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
