"""AdamW(lr_ratios=...): each named parameter steps at lr x its ratio, as torch.optim.AdamW over
param groups of those lrs does (LoRA+ makes such groups, tests/train/test_lora.py); a schedule
moves every group's lr alike. Bad ratios and unknown names are refused by name, and a checkpoint
holds the ratios it was trained with (a Trainer checkpoint, of one lr, is not written)."""
from __future__ import annotations

import math

import pytest
import torch

import megacompile
from megacompile.errors import MegacompileError, OptimizerInputError
from tests import models

LR = 1e-2
RATIOS = {"transformer.h.0.mlp.0.weight": 8.0, "transformer.h.1.attn.qkv.bias": 0.25}


def _model():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=32, layers=2, heads=2)


def _batches(n):
    return [models.batch(96, 2, 16, seed=i) for i in range(n)]


def _optimizer(ratios, kernel="torch", **kw):
    # a warm-up: each step's lr differs, and each ratio must follow it
    return megacompile.AdamW(lr=lambda step: LR * min(1.0, step / 3), weight_decay=0.1, kernel=kernel,
                             lr_ratios=ratios, **kw)


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_named_parameters_step_at_their_ratio_of_the_scheduled_lr(kernel):
    model, batches = _model(), _batches(4)
    names = {n for n, _ in model.named_parameters()}
    assert set(RATIOS) <= names
    eager = _model()
    named = list(eager.named_parameters())
    opt = torch.optim.AdamW([{"params": [p], "lr": LR * RATIOS.get(n, 1.0), "weight_decay": 0.1} for n, p in named])
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 3))
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        _, loss = eager(idx=ids, targets=ids)
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.item())
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=_optimizer(RATIOS, kernel))
    ours = [engine.step(idx=ids, targets=ids) for ids in batches]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    # The torch kernel rounds as torch.optim.AdamW does: the weights too. (The fused one rounds its
    # own way, which moves a weight whose gradient is rounding noise by about lr: losses only.)
    if kernel == "torch":
        state = engine.state_dict()
        for n, p in eager.named_parameters():
            torch.testing.assert_close(state[n], p.detach(), rtol=0, atol=2e-6)
    engine.close()


def test_bad_ratios_and_unknown_names_are_refused():
    name = "transformer.ln_f.weight"
    for bad, message in [({name: 0}, "ratio is a number in"), ({name: math.nan}, "ratio is a number"),
                         ({name: True}, "ratio is a number"), ([name], "lr_ratios takes"),
                         ({3: 2.0}, "not a parameter name")]:
        with pytest.raises(OptimizerInputError, match=message):
            megacompile.AdamW(lr_ratios=bad)
    with pytest.raises(OptimizerInputError, match=r"at lr 0.01 x 200 = 2, above 1"):
        megacompile.AdamW(lr=0.01, lr_ratios={name: 200.0})
    with pytest.raises(OptimizerInputError, match="'transformer.ln_f.wieght'.*named_parameters"):
        megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                            optimizer=megacompile.AdamW(lr_ratios={"transformer.ln_f.wieght": 2.0}))


@pytest.mark.parametrize("how, says", [
    ("schedule", r"step 2 runs at lr 0.02, and lr_ratios steps a parameter at 100 x that = 2, above 1"),
    ("param_groups", r"step 2 runs at lr 0.5 with weight_decay 4: AdamW multiplies each weight by 1 - lr"),
    ("param_groups_lr", r"step 2 runs at lr 3, above 1 .*param_groups\[0\]\['lr'\] gave it"),
])
def test_a_steps_lr_out_of_bounds_is_refused_before_anything_moves(how, says):
    """A schedule (a function of the step) or a value written into the LR handle's param group is
    held to the bounds a constant lr is held to when AdamW is made, each step, before it runs."""
    name = "transformer.h.0.mlp.0.weight"
    lr = (lambda step: 0.01 * step) if how == "schedule" else 0.01
    engine = megacompile.compile(_model(), hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(
        lr=lr, weight_decay=0.0 if how == "schedule" else 0.1, lr_ratios={name: 100.0} if how == "schedule" else ()))
    ids = _batches(1)[0]
    engine.step(idx=ids, targets=ids)
    if how == "param_groups":
        engine.torch_optimizer.param_groups[0].update(lr=0.5, weight_decay=4.0)
    elif how == "param_groups_lr":
        engine.torch_optimizer.param_groups[0]["lr"] = 3.0
    before = {n: t.clone() for n, t in engine.state_dict().items()}
    with pytest.raises(OptimizerInputError, match=says):
        engine.step(idx=ids, targets=ids)
    assert engine.steps_done == 1
    assert all(torch.equal(t, before[n]) for n, t in engine.state_dict().items())
    engine.close()


def test_a_checkpoint_keeps_its_ratios_and_an_engine_of_other_ratios_is_refused(tmp_path):
    batches = _batches(2)
    first = megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                                optimizer=_optimizer(RATIOS, no_decay=megacompile.hf_no_decay))
    first.step(idx=batches[0], targets=batches[0])
    first.save_checkpoint(str(tmp_path / "ck"))
    # A Trainer resumes its two param groups at one lr, or LoRA+'s four at one ratio: not these two ratios.
    with pytest.raises(MegacompileError, match="lr_ratios do not fit them \\(its ratios are 0.25, 8\\)"):
        first.save_trainer_checkpoint(str(tmp_path / "trainer"), batch_size=2)
    assert not (tmp_path / "trainer").exists()
    first.close()
    other = megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                                optimizer=_optimizer({}, no_decay=megacompile.hf_no_decay))
    with pytest.raises(MegacompileError, match="lr_ratios: the checkpoint has"):
        other.load_checkpoint(str(tmp_path / "ck"))
    other.close()
    same = megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                               optimizer=_optimizer(dict(RATIOS), no_decay=megacompile.hf_no_decay))
    same.load_checkpoint(str(tmp_path / "ck"))
    same.step(idx=batches[1], targets=batches[1])
    same.close()
