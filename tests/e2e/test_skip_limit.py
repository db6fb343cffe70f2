"""compile(..., max_consecutive_skips=N): with on_nonfinite="skip", N optimizer steps skipped in a
row raise NonFiniteError, with nothing updated (the limit's step is skipped as the others); an
update between skips starts the count again; a step of several micro-batches counts once."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import megacompile
from tests.e2e.atomic import Poisoned, assert_same_state, engine, inputs, snapshot

NAN = {"loss_scale": float("nan")}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Poisoned()


def _steps(e, poisoned: list[bool], k: int = 1) -> None:
    """One optimizer step per entry (k micro-batches each; the first poisoned where asked)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for n, bad in enumerate(poisoned):
            for i in range(k):
                e.step(**inputs(10 * n + i, **(NAN if bad and i == 0 else {})))
                if e.last_step.skipped:
                    break


def test_the_limit_stops_a_run_that_only_skips_and_changes_nothing(model):
    e = engine(copy.deepcopy(model), max_consecutive_skips=3)
    _steps(e, [False, True, True])
    before = snapshot(e)
    with pytest.raises(megacompile.NonFiniteError,
                       match=r"3 optimizer steps in a row were skipped, the last \(step 2\) because the loss is nan.*"
                             r"compile\(\.\.\., max_consecutive_skips=N\)"):
        e.step(**inputs(99, **NAN))
    assert_same_state(before, snapshot(e), grads=False)
    assert e.steps_done == 1 and e.skipped_steps == 3 and e.last_step.skipped == "loss"
    _steps(e, [False])                 # the engine goes on once the inputs are fixed
    assert e.steps_done == 2


def test_an_update_between_skips_restarts_the_count(model):
    e = engine(copy.deepcopy(model), max_consecutive_skips=3)
    _steps(e, [True, True, False, True, True, False, True, True])
    assert e.steps_done == 2 and e.skipped_steps == 6


def test_a_step_of_several_micro_batches_counts_once(model):
    e = engine(copy.deepcopy(model), grad_accum=2, max_consecutive_skips=2)
    _steps(e, [True, False], k=2)
    with pytest.raises(megacompile.NonFiniteError, match="2 optimizer steps in a row"):
        _steps(e, [True, True], k=2)


def test_without_a_limit_skips_never_stop(model):
    e = engine(copy.deepcopy(model))
    _steps(e, [True] * 8)
    assert e.skipped_steps == 8 and e.steps_done == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "50"])
def test_the_limit_is_a_positive_int_or_none(model, bad):
    with pytest.raises(megacompile.errors.ArgumentError, match="max_consecutive_skips"):
        engine(copy.deepcopy(model), max_consecutive_skips=bad)
