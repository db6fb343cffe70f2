"""Saved activations offloaded to host memory: exact training, the peak as predicted, and the
solver choosing it where the link is fast enough to beat recompute."""
from __future__ import annotations

import pytest
import torch

import megacompile
import megacompile.planner.search as planner
from megacompile.ir.program import Op
from megacompile.passes import ScheduleChoice
from megacompile.acceptance.parity import moment_error
from tests import models
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_noise


def test_offloaded_blocks_train_exactly_and_peak_as_predicted(monkeypatch):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=4)
    batches = [models.batch(96, 2, 16, seed=i) for i in range(5)]
    reference = clone(model)
    eager_moments, moments = {}, {}
    losses = eager_losses(reference, batches, "nanogpt", first_moments=eager_moments)
    # Force the schedule under test: the first two blocks offload, the third recomputes.
    forced = lambda blocks, *a, **k: (ScheduleChoice(1, frozenset(blocks[2:3]), offload=frozenset(blocks[:2]),  # noqa: E731
                                                     offload_lag=2), 0)
    monkeypatch.setattr(planner, "solve", forced)
    run = megacompile_run(clone(model), batches, "nanogpt", 1.0, first_moments=moments)
    nodes = run.engine.plan.program.nodes
    stashed = [n.stage for n in nodes if n.op is Op.OFFLOAD and n.reads[0].startswith("saved")]
    restored = [n.stage for n in nodes if n.op is Op.PREFETCH and n.writes[0].startswith("hsaved")]
    assert sorted(stashed) == sorted(restored) == [1, 2]
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, batches, "nanogpt", reference))
    assert all(peak == run.predicted for peak in run.peaks)
    assert run.engine.plan.stash_bytes > 0


@pytest.mark.long   # two plans of a 7B shape at 16 x 4096 tokens: 35-50 s on 2 cores
def test_solver_offloads_where_the_link_beats_recompute():
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}
    fast_link = megacompile.plan(config, 72, hardware="gh200", batch=16, seq=4096)
    assert len(fast_link.program.facts["choice"].offload) > 0          # NVLink-C2C: 450 GB/s
    assert fast_link.prediction.hardware_flops_per_model_flop < 1.2
    pcie = megacompile.plan(config, 72, hardware="h100", batch=16, seq=4096)
    assert fast_link.prediction.step_s < pcie.prediction.step_s
