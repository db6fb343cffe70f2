"""Bad input gets the project's own error, naming what is wrong, and leaves nothing half-done."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import megacompile
from tests import models

GiB = 2 ** 30


def _ids(t=16, seed=0):
    return models.batch(96, 2, t, seed=seed)


def test_budget_below_minimum_names_the_smallest_budget_and_changes_nothing():
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = megacompile.compile(model, hbm_budget=1e-5, device="cpu")
    with pytest.raises(megacompile.BudgetTooSmallError) as info:
        engine.step(idx=_ids(), targets=_ids())
    minimum = info.value.minimum_bytes
    stated = float(re.search(r"smallest budget that fits .* is ([0-9.e-]+) GiB", str(info.value)).group(1))
    assert stated == pytest.approx(minimum / GiB, rel=1e-3)
    for name, value in engine.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a step that never ran"
    # and the budget it names is enough
    ok = megacompile.compile(models.NanoGPT(vocab=96, d=64, layers=4), hbm_budget=stated * 1.001, device="cpu")
    ok.step(idx=_ids(), targets=_ids())
    assert ok.memory_stats()["device_peak_bytes"] <= stated * 1.001 * GiB


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.proj(x)
        if h.sum() > 0:          # data-dependent Python control flow cannot be traced
            h = h * 2
        return h


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), _Gate())

    def forward(self, x):
        return self.inner(x).pow(2).mean()


def test_untraceable_model_names_module_and_op():
    engine = megacompile.compile(_Untraceable(), hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.CaptureError) as info:
        engine.step(torch.randn(4, 16))
    message = str(info.value)
    assert "inner.1" in message and "_Gate.forward" in message
    assert "_local_scalar_dense" in message or "data-dependent" in message.lower()


class _Logits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)           # (B, 8): not a loss


def test_non_scalar_loss():
    engine = megacompile.compile(_Logits(), hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.LossError, match=r"shape \(4, 8\).*scalar"):
        engine.step(torch.randn(4, 8))


def test_loss_fn_makes_a_non_scalar_output_trainable():
    model = _Logits()
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu",
                                 loss_fn=lambda out, x: (out - x).pow(2).mean())
    x = torch.randn(4, 8)
    expected = (model(x) - x).pow(2).mean().item()
    assert engine.step(x) == pytest.approx(expected, rel=1e-6)


def test_model_without_parameters():
    with pytest.raises(megacompile.MegacompileError, match="no parameters"):
        megacompile.compile(nn.ReLU(), hbm_budget=1.0, device="cpu")


def test_other_input_shape_without_retrace():
    engine = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), hbm_budget=1.0, device="cpu",
                                 retrace=False)
    engine.step(idx=_ids(16), targets=_ids(16))
    with pytest.raises(megacompile.InputMismatchError, match=r"\(2, 8\).*\(2, 16\)"):
        engine.step(idx=_ids(8), targets=_ids(8))


def test_other_input_shape_with_retrace_builds_a_second_plan():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    reference = models.NanoGPT(vocab=96, d=32, layers=2)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(reference.parameters())
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    for t in (16, 8, 16):
        ours = engine.step(idx=_ids(t), targets=_ids(t))
        opt.zero_grad()
        _, loss = reference(_ids(t), _ids(t))
        loss.backward()
        opt.step()
        assert ours == pytest.approx(loss.item(), rel=1e-5)
    assert len(engine._compiled) == 2


def test_bad_budget_and_dtype_arguments():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    with pytest.raises(megacompile.MegacompileError, match="positive number"):
        megacompile.compile(model, hbm_budget=0, device="cpu")
    with pytest.raises(megacompile.MegacompileError, match="compute_dtype"):
        megacompile.compile(model, hbm_budget=1, device="cpu", compute_dtype=torch.float16)
    with pytest.raises(megacompile.OptimizerInputError, match="betas"):
        megacompile.AdamW(betas=(0.9, 1.5))
