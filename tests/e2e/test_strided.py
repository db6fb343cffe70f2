"""A plan that recomputes every m-th block and offloads the others (planner/solve.py, `stride`)
trains exactly as eager PyTorch, with the peak the plan predicted."""
from __future__ import annotations

import pytest
import torch

import megacompile.planner.search as planner
from megacompile.acceptance.parity import moment_error
from megacompile.ir.program import Op
from megacompile.planner.solve import Family, solve
from tests import models
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_noise


@pytest.mark.parametrize("boundary", [False, True])
def test_every_other_block_recomputed_the_rest_offloaded_trains_exactly(monkeypatch, boundary):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=6)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(4)]
    reference = clone(model)
    eager_moments, moments = {}, {}
    losses = eager_losses(reference, batches, "nanogpt", first_moments=eager_moments)

    # The solver's own search, held to the one strided family under test.
    def strided(blocks, budget, peak_of, seconds_of=None, options=None, exact_of=None, floor_of=None):
        return solve(blocks, budget, peak_of, seconds_of,
                     [Family(1, offloaded=len(blocks), stride=2, lag=2, boundary=boundary)])
    monkeypatch.setattr(planner, "solve", strided)
    run = megacompile_run(clone(model), batches, "nanogpt", 1.0, first_moments=moments)
    plan = run.engine.plan
    blocks = [s for s, st in enumerate(plan.captured.stages) if st.template.kind == "block"]
    nodes = plan.program.nodes
    recomputed = sorted({n.stage for n in nodes if n.op is Op.RECOMPUTE})
    stashed = sorted(n.stage for n in nodes if n.op is Op.OFFLOAD and n.reads[0].startswith("saved"))
    assert recomputed == blocks[0::2] and stashed == blocks[1::2]
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, batches, "nanogpt", reference))
    assert all(peak == run.predicted for peak in run.peaks)
