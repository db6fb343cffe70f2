"""Block inputs offloaded to host memory between a block's forward and its backward half: exact
training against eager, the peak as predicted and lower than with the inputs kept, and the host
bytes counted."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import megacompile
import megacompile.planner.search as planner
from megacompile.ir.program import Op, restored_of
from megacompile.ir.simulate import simulate
from megacompile.passes import ScheduleChoice, build_schedule
from megacompile.acceptance.parity import moment_error
from tests import models
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_noise


def _forced(blocks, *a, **k):
    # Every block recomputed or offloaded: then only its input would stay on the device.
    recompute, offload = frozenset(blocks[1:]), frozenset(blocks[:1])
    return ScheduleChoice(0, recompute, offload=offload, offload_lag=1, selective=frozenset(blocks),
                          boundary=recompute | offload), 0


def test_offloaded_block_inputs_train_exactly_and_peak_as_predicted(monkeypatch):
    torch.manual_seed(0)
    # Deep and narrow, so the blocks' inputs (8 x 32 x 32 floats each) outweigh a block's working set.
    model = models.hf_llama(layers=12, d=32)
    batches = [models.batch(model.config.vocab_size, 8, 32, seed=i) for i in range(3)]
    reference = clone(model)
    eager_moments, moments = {}, {}
    losses = eager_losses(reference, batches, "llama", first_moments=eager_moments)
    monkeypatch.setattr(planner, "solve", _forced)
    run = megacompile_run(clone(model), batches, "llama", 1.0, first_moments=moments)
    program = run.engine.plan.program
    kind = {n: v.kind for n, v in program.values.items()}
    sent = [n.reads[0] for n in program.nodes if n.op is Op.OFFLOAD and kind[n.reads[0]] == "activation"]
    back = [n.writes[0] for n in program.nodes if n.op is Op.PREFETCH and kind[n.writes[0]] == "activation"]
    assert len(sent) >= 4 and sorted(back) == sorted(restored_of(v) for v in sent)
    # The recomputes and backwards read the copies from host memory, never the originals.
    readers = [n for n in program.nodes if n.op in (Op.RECOMPUTE, Op.BACKWARD)]
    assert not any(v in n.reads for n in readers for v in sent)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, batches, "llama", reference))
    assert all(peak == run.predicted for peak in run.peaks)
    plan = run.engine.plan
    assert plan.stash_bytes == sum(program.values[v].nbytes for v in sent) + sum(
        program.values[n.reads[0]].nbytes for n in program.nodes
        if n.op is Op.OFFLOAD and program.values[n.reads[0]].kind == "saved")
    kept = build_schedule(plan.captured, dataclasses.replace(program.facts["choice"], boundary=frozenset()))
    assert run.predicted < simulate(kept).peak


@pytest.mark.slow
def test_smallest_budget_sends_block_inputs_to_host_and_trains_exactly():
    """At the smallest budget the solver itself chooses to send the blocks' inputs away."""
    torch.manual_seed(1)
    model = models.hf_llama(layers=12, d=32)
    batches = [models.batch(model.config.vocab_size, 8, 32, seed=i) for i in range(3)]
    probe = megacompile.compile(clone(model), hbm_budget=64, device="cpu")
    smallest = probe.prepare(input_ids=batches[0], labels=batches[0]).minimum_budget_bytes
    reference = clone(model)
    eager_moments, moments = {}, {}
    losses = eager_losses(reference, batches, "llama", first_moments=eager_moments)
    run = megacompile_run(clone(model), batches, "llama", smallest / 2 ** 30, first_moments=moments)
    assert run.engine.plan.program.facts["boundary_values"], "the smallest plan keeps every block input"
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, batches, "llama", reference))
    assert all(peak == run.predicted for peak in run.peaks)
