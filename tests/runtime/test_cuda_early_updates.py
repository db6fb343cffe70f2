"""Updates as gradients land on the cuda backend's own code (a stand-in torch.cuda,
tests/runtime/fake_gpu.py): each early update waits for the host side of its gradients' landing
(CopiedThenLanded.landed, not the device copy alone), and training is bit for bit that of updates
at commit."""
from __future__ import annotations

import pytest
import torch

from megacompile.acceptance.parity import AdamW, BETAS, EPS, LR, WD, clone, make_inputs
from tests import models
from tests.runtime.fake_gpu import FakeGpu


@pytest.fixture
def gpu(monkeypatch):
    return FakeGpu().install(monkeypatch)


def _train(gpu, monkeypatch, model, batches, updates: str):
    import megacompile
    from megacompile.engine import engine as engine_module
    from megacompile.runtime import cuda
    monkeypatch.setattr(engine_module, "make_backend", lambda device, budget: gpu.backend(budget))
    monkeypatch.setattr(cuda, "SMALL_OUTPUT_BYTES", -1)     # the loss in a registered buffer
    engine = megacompile.compile(model, hbm_budget=1.0, device="cuda", fuse=False, updates=updates,
                                 optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))
    try:
        waited = []
        early = engine._compile((), make_inputs("nanogpt", batches[0]), train=True).executor.early
        if early is not None:       # what each early update was handed to wait for
            start = early.start

            def spy(node_index, owner, landed, *args):
                waited.extend(type(landed[s]).__name__ for s in early.waits_for[owner] if s in landed)
                return start(node_index, owner, landed, *args)
            early.start = spy
        losses = [engine.step(**make_inputs("nanogpt", ids)) for ids in batches]
        return losses, engine.state_dict(), waited
    finally:
        engine.close()


def test_updates_as_gradients_land_on_the_cuda_backend_train_as_at_commit(gpu, monkeypatch):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=3)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(3)]
    at_commit = _train(gpu, monkeypatch, clone(model), batches, "at_commit")
    landing = _train(gpu, monkeypatch, clone(model), batches, "as_gradients_land")
    assert landing[0] == at_commit[0]
    for name, value in at_commit[1].items():
        assert torch.equal(value, landing[1][name]), name
    # Host-side landings (threads' events), never a device copy's event: the update reads what the
    # landing wrote and checked.
    assert landing[2] and set(landing[2]) == {"ThreadEvent"}, landing[2]
