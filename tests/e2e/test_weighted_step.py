"""engine.weighted_step(w, ...): a micro-batch's loss gradient is w, not 1/grad_accum, in both
accumulation orders. Held against eager accumulation ((w * loss).backward() per micro-batch, then one
torch.optim.AdamW step), where weights other than 1/k train measurably otherwise."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import BETAS, EPS, LR, WD, clone, float64_noise, loss_of, make_inputs
from megacompile.errors import ArgumentError
from megacompile.optim import AdamW
from tests import models
from tests.e2e.harness import assert_same_weights

K = 2
WEIGHTS = [0.2, 0.8, 0.7, 0.3]     # two optimizer steps of two micro-batches


def _eager(model, batches, weights):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for s in range(0, len(batches), K):
        opt.zero_grad(set_to_none=True)
        for ids, w in zip(batches[s:s + K], weights[s:s + K]):
            loss = loss_of(model(**make_inputs("llama", ids)))
            (w * loss).backward()
            losses.append(loss.item())
        opt.step()
    return losses


@pytest.mark.parametrize("accumulation", ["micro", "layer"])
def test_weighted_micro_batches_train_as_weighted_eager_accumulation(accumulation):
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    batches = [models.batch(model.config.vocab_size, 2, 16, seed=i) for i in range(len(WEIGHTS))]
    reference, even = clone(model), clone(model)
    eager = _eager(reference, batches, WEIGHTS)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu", grad_accum=K, accumulation=accumulation,
                                 optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))
    losses = []
    for ids, w in zip(batches, WEIGHTS):
        loss = engine.weighted_step(w, **make_inputs("llama", ids))
        if accumulation == "micro":
            losses.append(loss)
        elif engine.last_step.updated:       # layer-major: the step's losses once its last micro-batch ran
            losses += engine.accumulated_losses
    engine.synchronize()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(lambda m: _eager(m, batches, WEIGHTS), model,
                                                               reference))
    # 1/k weights train another model: the weights above were taken.
    _eager(even, batches, [1 / K] * len(WEIGHTS))
    with pytest.raises(AssertionError):
        assert_same_weights(engine, even)
    engine.close()


@pytest.mark.parametrize("weight", [0, -0.5, float("nan"), float("inf"), "half", True])
def test_a_weight_that_is_no_share_is_refused_before_anything_runs(weight):
    model = models.hf_llama(layers=1, d=32)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=K)
    with pytest.raises(ArgumentError, match="weighted_step: weight must be a finite number > 0"):
        engine.weighted_step(weight, **make_inputs("llama", models.batch(model.config.vocab_size, 1, 8)))
    assert engine.state.micro_batches == 0
    engine.close()


def test_weight_zero_says_to_leave_a_micro_batch_without_tokens_out():
    model = models.hf_llama(layers=1, d=32)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=K)
    with pytest.raises(ArgumentError, match="no counted token .* is left out of the step: run grad_accum others "
                                            "whose weights add up to 1"):
        engine.weighted_step(0.0, **make_inputs("llama", models.batch(model.config.vocab_size, 1, 8)))
    engine.close()
