"""Recompute is exact: a recomputed block replays its forward's random state."""
from __future__ import annotations

import torch

import megacompile
from tests import models
from tests.e2e.harness import clone, make_inputs

GiB = 2 ** 30


def _train(model, budget_gib: float, batches) -> tuple[list[float], dict, megacompile.Engine]:
    engine = megacompile.compile(model, hbm_budget=budget_gib, device="cpu", optimizer=megacompile.AdamW(lr=1e-3))
    losses = []
    torch.manual_seed(1234)
    for ids in batches:
        losses.append(engine.step(**make_inputs("nanogpt", ids)))
    return losses, engine.state_dict(), engine


def test_recomputed_dropout_masks_match_the_original_forward():
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4, heads=4, dropout=0.2).train()
    batches = [models.batch(96, 2, 16, seed=i) for i in range(3)]
    kept_losses, kept, kept_engine = _train(clone(model), 64.0, batches)
    assert kept_engine.plan.recomputed == []
    smallest = kept_engine.plan.minimum_budget_bytes
    re_losses, re, re_engine = _train(clone(model), smallest / GiB, batches)
    assert re_engine.plan.recomputed, "the smallest budget must force recompute"
    assert re_losses == kept_losses
    for name in kept:
        assert torch.equal(kept[name], re[name]), name


def test_dropout_training_matches_eager():
    """The schedule draws random numbers in eager's order, so even dropout runs match eager."""
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=3, heads=4, dropout=0.2).train()
    batches = [models.batch(96, 2, 16, seed=i) for i in range(3)]
    reference = clone(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    torch.manual_seed(1234)
    eager = []
    for ids in batches:
        opt.zero_grad()
        _, loss = reference(ids, ids)
        loss.backward()
        opt.step()
        eager.append(loss.item())
    ours, _, engine = _train(clone(model), engine_budget(model), batches)
    assert engine.plan.recomputed, "the budget must force recompute for this test to mean anything"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)


def engine_budget(model) -> float:
    probe = megacompile.compile(clone(model), hbm_budget=64.0, device="cpu")
    probe.step(**make_inputs("nanogpt", models.batch(96, 2, 16)))
    return probe.plan.minimum_budget_bytes / GiB
