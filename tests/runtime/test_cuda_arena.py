"""The device arena on the cuda backend's own code, on a stand-in torch.cuda (tests/runtime/fake_gpu.py):
the arena's tensors are made through the CUDA array interface over the one allocation, the step's
tensors are all among them, training is eager's, and a plan needing a larger arena replaces it
once (the old one given back first), after which both plans serve from the new one; a frozen
reference compiled with share_device serves from that same one allocation."""
from __future__ import annotations

import pytest
import torch

from megacompile.acceptance.parity import AdamW, BETAS, EPS, LR, WD, clone, eager_losses, make_inputs
from tests import models
from tests.runtime.fake_gpu import FakeGpu


@pytest.fixture
def gpu(monkeypatch):
    return FakeGpu().install(monkeypatch)


def _engine(gpu, monkeypatch, model):
    import megacompile
    from megacompile.engine import engine as engine_module
    from megacompile.runtime import cuda
    monkeypatch.setattr(engine_module, "make_backend", lambda device, budget: gpu.backend(budget))
    monkeypatch.setattr(cuda, "SMALL_OUTPUT_BYTES", -1)     # the loss in a registered buffer (no pinned allocator here)
    return megacompile.compile(model, hbm_budget=1.0, device="cuda", fuse=False,
                               optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))


def test_the_cuda_backend_serves_every_tensor_of_a_step_from_its_arena(gpu, monkeypatch):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(3)]
    expected = eager_losses(clone(model), batches, "nanogpt")
    engine = _engine(gpu, monkeypatch, clone(model))
    try:
        losses = []
        for ids in batches:
            losses.append(engine.step(**make_inputs("nanogpt", ids)))
            stats = engine.memory_stats()
            assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
            assert stats["device_peak_bytes"] <= stats["device_arena_bytes"] == engine.plan.arena.size
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        # Every planned tensor was made once, through the interface, inside the one allocation.
        base, size = engine.backend.arena.buffer.data_ptr(), engine.backend.arena.size
        made = [(ptr, n) for kind, *rest in gpu.log if kind == "interface" for ptr, n in [rest]]
        assert len(made) == len(engine.plan.arena.tensors)
        assert all(base <= ptr and ptr + n <= base + size for ptr, n in made)
        assert sorted(ptr - base for ptr, _ in made) == sorted(t.offset for t in engine.plan.arena.tensors)
    finally:
        engine.close()


def test_a_plan_with_a_larger_arena_replaces_it_once_and_both_plans_serve_from_the_new_one(gpu, monkeypatch):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    short, long = models.batch(96, 2, 16, seed=0), models.batch(96, 2, 32, seed=1)
    reference = clone(model)
    expected = eager_losses(reference, [short, long, short], "nanogpt")
    engine = _engine(gpu, monkeypatch, clone(model))
    try:
        losses = [engine.step(**make_inputs("nanogpt", short))]
        first = engine.backend.arena.size
        losses.append(engine.step(**make_inputs("nanogpt", long)))
        assert engine.backend.arena.size > first and engine.backend.arena.regrown == 1
        assert ("empty_cache",) in gpu.log          # the old arena went back before the new one came
        losses.append(engine.step(**make_inputs("nanogpt", short)))
        assert engine.backend.arena.regrown == 1     # the short plan fits the larger arena
        stats = engine.memory_stats()
        assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
        assert stats["device_arena_bytes"] > engine.plan.arena.size
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    finally:
        engine.close()


def test_a_reference_sharing_the_device_serves_from_the_same_single_arena(gpu, monkeypatch):
    # compile(..., share_device=): a frozen model beside the trained one on the cuda backend's own
    # code: one allocation for both, every tensor of either's runs inside it, both exact.
    import copy

    import megacompile
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    frozen = copy.deepcopy(model).requires_grad_(False)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(2)]
    expected = eager_losses(clone(model), batches, "nanogpt")
    with torch.no_grad():
        expected_reference = [frozen(**make_inputs("nanogpt", ids))[1].item() for ids in batches]
    engine = _engine(gpu, monkeypatch, clone(model))
    reference = megacompile.compile(frozen, hbm_budget=1.0, fuse=False, share_device=engine)
    try:
        losses, referred = [], []
        for ids in batches:
            referred.append(float(reference(**make_inputs("nanogpt", ids))[1]))
            losses.append(engine.step(**make_inputs("nanogpt", ids)))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
        assert referred == pytest.approx(expected_reference, rel=1e-6)
        assert reference.backend is engine.backend and reference.device == engine.device
        arena = engine.backend.arena
        assert arena.size == max(engine.plan.arena.size, reference.plan.arena.size) and arena.regrown <= 1
        base = arena.buffer.data_ptr()
        made = [(ptr, n) for kind, *rest in gpu.log if kind == "interface" for ptr, n in [rest]]
        assert all(base <= ptr and ptr + n <= base + arena.size for ptr, n in made[-len(engine.plan.arena.tensors):])
        for e in (engine, reference):
            stats = e.memory_stats()
            assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
        assert set(reference.host.parts()) == {"frozen weights and buffers"}
    finally:
        engine.close()
        reference.close()
