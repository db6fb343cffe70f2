"""engine.torch_optimizer's param group drives the whole host AdamW, as torch.optim.AdamW's does: lr,
betas, eps and weight_decay are read when each step starts, whether a scheduler writes them
(OneCycleLR cycles betas[0]) or the user does, and a checkpoint brings back what it left there.

Each is held against the eager loop a user would write with torch.optim.AdamW.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

import megacompile
from tests import models
from tests.e2e.harness import assert_same_weights, clone, float64_noise

LR, BETAS, WD, STEPS = 1e-3, (0.9, 0.95), 0.1, 6


def _model():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=64, layers=3)


def _batches(n=STEPS):
    return [models.batch(96, 2, 16, seed=i) for i in range(n)]


def _engine(model, kernel="torch", betas=BETAS):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=LR, betas=betas, weight_decay=WD, kernel=kernel))


def _one_cycle(optimizer):
    # cycle_momentum=True (the default): betas[0] runs 0.95 -> 0.85 -> 0.95 against the rate
    return OneCycleLR(optimizer, max_lr=1e-2, total_steps=STEPS)


def _eager(batches, edit=None, schedule=None):
    """train(model): eager AdamW over `batches`; schedule(opt) makes a scheduler stepped after each
    step; edit(step, group) may change the param group before a step. Returns the losses."""
    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        scheduler = schedule(opt) if schedule else None
        losses = []
        for i, ids in enumerate(batches):
            if edit:
                edit(i, opt.param_groups[0])
            opt.zero_grad()
            _, loss = m(ids, ids)
            loss.backward()
            opt.step()
            if scheduler:
                scheduler.step()
            losses.append(loss.item())
        return losses
    return train


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_one_cycle_lr_cycles_beta1_as_it_does_for_torch_adamw(kernel):
    model, batches = _model(), _batches()
    train = _eager(batches, schedule=_one_cycle)
    reference = clone(model)
    eager = train(reference)
    engine = _engine(clone(model), kernel)
    scheduler = _one_cycle(engine.torch_optimizer)
    ours, beta1 = [], []
    for ids in batches:
        beta1.append(engine.torch_optimizer.param_groups[0]["betas"][0])
        ours.append(engine.step(idx=ids, targets=ids))
        scheduler.step()
    assert max(beta1) - min(beta1) > 0.05, "the schedule must move beta1 for the test to mean anything"
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(train, model, reference))


def test_param_group_edits_of_betas_eps_and_weight_decay_apply_from_the_next_step():
    model, batches = _model(), _batches(4)

    def edit(step, group):
        if step == 2:
            group.update(betas=(0.5, 0.9), eps=1e-3, weight_decay=0.3)
    train = _eager(batches, edit=edit)
    reference = clone(model)
    eager = train(reference)
    engine = _engine(clone(model))
    ours = []
    for i, ids in enumerate(batches):
        edit(i, engine.torch_optimizer.param_groups[0])
        ours.append(engine.step(idx=ids, targets=ids))
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(train, model, reference))
    assert engine.last_step.lr == LR


@pytest.mark.parametrize("key, value", [("betas", (1.2, 0.999)), ("betas", 0.9), ("eps", 0.0),
                                        ("weight_decay", float("nan")), ("lr", -1.0)])
def test_a_bad_value_in_the_param_group_is_refused_before_the_step_runs(key, value):
    engine, ids = _engine(_model()), _batches(1)[0]
    engine.step(idx=ids, targets=ids)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.torch_optimizer.param_groups[0][key] = value
    with pytest.raises(megacompile.OptimizerInputError, match=rf"param_groups\[0\]\['{key}'\]"):
        engine.step(idx=ids, targets=ids)
    assert engine.steps_done == 1
    assert all(torch.equal(v, before[k]) for k, v in engine.state_dict().items())


def _run(engine, scheduler, batches):
    losses = []
    for ids in batches:
        losses.append(engine.step(idx=ids, targets=ids))
        scheduler.step()
    return losses


def test_a_resumed_one_cycle_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    model, batches = _model(), _batches()
    straight, first = _engine(clone(model)), _engine(clone(model))
    s_straight, s_first = _one_cycle(straight.torch_optimizer), _one_cycle(first.torch_optimizer)
    _run(straight, s_straight, batches[:3])
    _run(first, s_first, batches[:3])
    path = str(tmp_path / "ckpt")
    first.save_checkpoint(path)
    saved = dict(first.torch_optimizer.param_groups[0])
    expected = _run(straight, s_straight, batches[3:])
    resumed = _engine(clone(model))
    s_resumed = _one_cycle(resumed.torch_optimizer)    # sets betas[0] for step 1 until the load
    resumed.load_checkpoint(path)
    group = resumed.torch_optimizer.param_groups[0]
    assert (tuple(group["betas"]), group["lr"]) == (tuple(saved["betas"]), saved["lr"]) != ((0.95, BETAS[1]), LR)
    assert _run(resumed, s_resumed, batches[3:]) == expected
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_an_engine_with_other_betas_keeps_its_own_over_the_checkpoints(tmp_path):
    """strict=False keeps this engine's settings: its betas, not the saved param group's."""
    ids = _batches(1)[0]
    first = _engine(_model())
    first.step(idx=ids, targets=ids)
    first.save_checkpoint(str(tmp_path / "ckpt"))
    other = _engine(_model(), betas=(0.8, 0.99))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_checkpoint(str(tmp_path / "ckpt"), strict=False)
    assert any("betas" in str(w.message) for w in caught)
    assert tuple(other.torch_optimizer.param_groups[0]["betas"]) == (0.8, 0.99)
