"""A step that raises anywhere leaves masters, moments, counters, the gradients of earlier
micro-batches and the device ledger exactly as they were, and the next step is exactly the
one a run without the failure takes.

Exceptions are injected at every node of one step in turn (the executor's dispatch), inside the
copy thread that lands gradients, and at the budget guard while stage graphs run."""
from __future__ import annotations

import copy

import pytest
import torch

from megacompile.errors import BudgetExceededError
from megacompile.ir.program import Op
from megacompile.runtime.executor import Executor
from megacompile.runtime.host import HostState
from megacompile.runtime.memory import DeviceMemory
from tests.e2e.atomic import Poisoned, assert_same_state, engine, inputs, snapshot

KINDS = [RuntimeError, KeyboardInterrupt, BudgetExceededError]


class Injected:
    """Raise `error` at the `at`-th call of the patched functions (counting from 0), once."""

    def __init__(self):
        self.at, self.calls, self.error = -1, 0, RuntimeError

    def arm(self, at: int, error: type) -> None:
        self.at, self.calls, self.error = at, 0, error

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            n, self.calls = self.calls, self.calls + 1
            if n == self.at:
                self.at = -1
                raise self.error("injected")
            return fn(*args, **kwargs)
        return wrapped


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Poisoned(layers=2, d=16)


def _sweep(e, clean: dict, injected: Injected, count: int, checkpoint: str, grads: bool) -> int:
    """For each of `count` places: fail there, check nothing moved, take the clean step and
    compare with the uninjected one, go back to the saved state."""
    before = snapshot(e)
    e.step(**clean)
    expected = snapshot(e)
    e.load_checkpoint(checkpoint)
    for at in range(count):
        error = KINDS[at % len(KINDS)]
        injected.arm(at, error)
        with pytest.raises(error, match="injected"):
            e.step(**clean)
        assert injected.at == -1, f"place {at} was never reached"
        assert_same_state(before, snapshot(e), grads=grads)
        e.step(**clean)
        assert_same_state(expected, snapshot(e))
        e.load_checkpoint(checkpoint)
    return count


# 20-35 s each on two cores; the first micro-batch of two with -m long (k1 and the last one stand for it)
@pytest.mark.parametrize("k,micro,clip", [pytest.param(1, 0, False, marks=pytest.mark.slow, id="k1"),
                                          pytest.param(2, 0, False, marks=pytest.mark.long, id="k2-first"),
                                          pytest.param(2, 1, True, marks=pytest.mark.slow, id="k2-last-clip")])
def test_an_exception_anywhere_in_a_step_changes_nothing(model, tmp_path, monkeypatch, k, micro, clip):
    e = engine(copy.deepcopy(model), clip=clip, grad_accum=k)
    for seed in range(k + micro):                     # one whole step, then `micro` micro-batches
        e.step(**inputs(seed))
    checkpoint = str(tmp_path / "before.pt")
    e.save_checkpoint(checkpoint)
    clean = inputs(99)
    plan = e._compile((), clean, train=True, update=micro == k - 1).plan
    nodes = len(plan.program.nodes)
    injected = Injected()
    for op in Op:
        name = "_" + op.value
        monkeypatch.setattr(Executor, name, injected.wrap(getattr(Executor, name)))
    swept = _sweep(e, clean, injected, nodes, checkpoint, grads=micro > 0)
    assert swept == nodes
    monkeypatch.undo()

    # The copy thread that adds each landed gradient into the host sums.
    monkeypatch.setattr(HostState, "accumulate_grad", injected.wrap(HostState.accumulate_grad))
    injected.arm(-1, RuntimeError)
    e.step(**clean)
    landed = injected.calls
    e.load_checkpoint(checkpoint)
    _sweep(e, clean, injected, landed, checkpoint, grads=micro > 0)
    monkeypatch.undo()

    # The budget guard, between ops inside the stage graphs (every 5th hold of the step).
    monkeypatch.setattr(DeviceMemory, "hold", injected.wrap(DeviceMemory.hold))
    injected.arm(-1, RuntimeError)
    e.step(**clean)
    holds = injected.calls
    e.load_checkpoint(checkpoint)
    before = snapshot(e)
    e.step(**clean)
    expected = snapshot(e)
    e.load_checkpoint(checkpoint)
    for at in range(0, holds, 5):
        injected.arm(at, BudgetExceededError)
        with pytest.raises(BudgetExceededError):
            e.step(**clean)
        assert_same_state(before, snapshot(e), grads=micro > 0)
        e.step(**clean)
        assert_same_state(expected, snapshot(e))
        e.load_checkpoint(checkpoint)


def test_a_step_interrupted_mid_backward_updates_nothing_and_a_retry_is_exact(model, monkeypatch):
    """The quick member of the sweep, in the default tier: KeyboardInterrupt at the third
    backward, after the first owners' gradients landed."""
    e, reference = engine(copy.deepcopy(model)), engine(copy.deepcopy(model))
    for x in (e, reference):
        x.step(**inputs(0))
        x.step(**inputs(1))
    before = snapshot(e)
    seen = []
    original = Executor._backward

    def interrupted(self, node):
        seen.append(node)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return original(self, node)
    monkeypatch.setattr(Executor, "_backward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        e.step(**inputs(2))
    monkeypatch.undo()
    assert_same_state(before, snapshot(e), grads=False)
    e.step(**inputs(2))
    reference.step(**inputs(2))
    assert_same_state(snapshot(reference), snapshot(e))
