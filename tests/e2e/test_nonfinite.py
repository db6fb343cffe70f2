"""A step whose loss or any gradient is inf or NaN changes no master, moment or counter: it is
skipped with a warning (or raises, with on_nonfinite="raise"), and the next step is exactly
the one an unpoisoned run takes."""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from tests.e2e.atomic import (Poisoned, assert_bit_equal, assert_same_state, engine, inputs, masters,
                              snapshot)

POISONS = {"loss_inf": {"loss_scale": float("inf")}, "loss_nan": {"loss_scale": float("nan")},
           "grad_nan": {"grad_poison": 0.0}}


def _window(e, seed: int, k: int, poison: dict | None = None, at: int = 0) -> None:
    """One optimizer step: k micro-batches, the `at`-th poisoned."""
    for i in range(k):
        e.step(**inputs(seed * 10 + i, **(poison if i == at and poison else {})))
        if e.last_step.skipped:
            return


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Poisoned()


@pytest.mark.parametrize("k,clip", [
    pytest.param(1, False, id="k1-noclip"), pytest.param(2, True, id="k2-clip"),
    pytest.param(1, True, id="k1-clip", marks=pytest.mark.slow),
    pytest.param(2, False, id="k2-noclip", marks=pytest.mark.slow)])
def test_a_non_finite_step_changes_nothing_and_the_next_is_exact(model, k, clip):
    """Each poison (inf loss, NaN loss, one NaN gradient) in each micro-batch of a step, in turn;
    the run beside it never sees a poison. After every skip both take the same clean step."""
    ours, reference = engine(copy.deepcopy(model), clip=clip, grad_accum=k), \
        engine(copy.deepcopy(model), clip=clip, grad_accum=k)
    for e in (ours, reference):
        _window(e, 1, k)                     # moments and counters are not zero any more
    cases = [(poison, at) for poison in POISONS for at in range(k)]
    for n, (poison, at) in enumerate(cases):
        before = snapshot(ours)
        with pytest.warns(RuntimeWarning, match="skipped"):
            _window(ours, 2 + n, k, POISONS[poison], at)
        record = ours.last_step
        assert record.skipped == ("gradient" if poison == "grad_nan" else "loss"), (poison, at)
        assert not record.updated and record.step == 2 + n
        if poison == "grad_nan":
            assert "transformer.ln_f.weight" in record.reason
        assert ours.skipped_steps == n + 1
        assert_same_state(before, snapshot(ours), grads=False)
        for e in (ours, reference):
            _window(e, 100 + n, k)
        assert ours.last_step.updated and not ours.last_step.skipped
        assert ours.steps_done == reference.steps_done == 2 + n
        assert_bit_equal(masters(ours), masters(reference))


def test_raise_leaves_the_state_as_it_was(model):
    e = engine(copy.deepcopy(model), clip=True, on_nonfinite="raise")
    e.step(**inputs(0))
    before = snapshot(e)
    with pytest.raises(megacompile.NonFiniteError, match="gradients hold inf or NaN"):
        e.step(**inputs(1, grad_poison=0.0))
    assert_same_state(before, snapshot(e), grads=False)
    assert e.last_step.skipped == "gradient"
    e.step(**inputs(2))
    assert e.steps_done == 2


def test_last_step_reports_the_clipped_norm(model):
    e = engine(copy.deepcopy(model), clip=True)
    loss = e.step(**inputs(0))
    record = e.last_step
    assert record.loss == loss and record.step == 1 and record.updated and record.skipped is None
    assert record.grad_norm is not None and record.grad_norm > 0


def test_on_nonfinite_must_be_skip_or_raise(model):
    with pytest.raises(megacompile.MegacompileError, match="on_nonfinite"):
        megacompile.compile(copy.deepcopy(model), hbm_budget=1.0, device="cpu", on_nonfinite="ignore")
