"""Race injection: with MEGACOMPILE_INJECT_DELAYS set, every copy-stream task sleeps 0-5 ms and
every host optimizer task 0-50 ms before it runs. A schedule that waits on an event for
everything it reads trains bit-identically with and without the delays, and still agrees with
eager torch.optim.AdamW to 1e-5."""
from __future__ import annotations

import pytest
import torch

import megacompile
import megacompile.planner.search as search
from megacompile.ir.program import Op
from megacompile.passes.optimizer import updates_in_forward_order
from megacompile.planner.update_order import fastest_update_order
from megacompile.runtime.delays import ENV
from tests import models
from tests.e2e.harness import clone, eager_losses, make_inputs, megacompile_run, weight_bytes

GiB = 2 ** 30
STEPS = 3


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = models.hf_llama(layers=4, d=32)
    batches = [models.batch(96, b=2, t=24, seed=i) for i in range(STEPS)]
    probe = megacompile.compile(clone(model), 64.0, device="cpu")
    minimum = probe.prepare(**make_inputs("llama", batches[0])).minimum_budget_bytes
    probe.close()
    return model, batches, minimum, eager_losses(clone(model), batches, "llama")


# tight: offload, recompute and no prefetch overlap; roomy: prefetch two stages ahead and
# updates running into the next step. grad_accum=2 adds gradient sums across micro-batches. Updates
# as gradients land run during the backward, and the last step's may still run as the next begins;
# "moved": half of them moved to the end of the backward, in forward order (planner/update_order.py).
@pytest.mark.parametrize("budget, grad_accum, updates", [
    ("tight", 1, "at_commit"), ("tight", 1, "as_gradients_land"), ("tight", 1, "moved"),
    pytest.param("roomy", 2, "at_commit", marks=pytest.mark.slow),
    pytest.param("roomy", 1, "as_gradients_land", marks=pytest.mark.slow)])
def test_delays_change_no_bit(budget, grad_accum, updates, setup, monkeypatch):
    model, batches, minimum, eager = setup
    if updates == "moved":
        def half_moved(program, *args, **kwargs):
            return updates_in_forward_order(program, sum(n.op is Op.OPTIMIZER_STEP for n in program.nodes) // 2)
        monkeypatch.setattr(search, "fastest_update_order", half_moved)
        updates = "as_gradients_land"
    budget_gib = minimum * 1.2 / GiB if budget == "tight" else 2 * weight_bytes(model) / GiB
    monkeypatch.delenv(ENV, raising=False)
    plain = megacompile_run(clone(model), batches, "llama", budget_gib, grad_accum=grad_accum, updates=updates)
    monkeypatch.setenv(ENV, "7")
    injected = megacompile_run(clone(model), batches, "llama", budget_gib, grad_accum=grad_accum, updates=updates)
    assert injected.engine.backend.host._delay is not None, "the switch did not reach the streams"
    if search.fastest_update_order is not fastest_update_order:
        assert injected.engine.plan.program.facts["updates_in_forward_order"] >= 2
    assert injected.losses == plain.losses
    ours, theirs = injected.engine.state_dict(), plain.engine.state_dict()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{name} differs under injected delays"
    if grad_accum == 1:
        torch.testing.assert_close(torch.tensor(injected.losses), torch.tensor(eager), rtol=1e-5, atol=0)
    for run in (plain, injected):
        assert max(run.peaks) <= run.engine.budget_bytes
        run.engine.close()


def test_switch_is_off_when_unset_and_rejects_junk(monkeypatch):
    from megacompile.errors import ArgumentError
    from megacompile.runtime.delays import injected_delay
    monkeypatch.delenv(ENV, raising=False)
    assert injected_delay("host") is None
    monkeypatch.setenv(ENV, "0")
    assert injected_delay("h2d") is None
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ArgumentError, match=ENV):
        injected_delay("host")
