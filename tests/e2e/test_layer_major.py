"""Layer-major accumulation: the k micro-batches of a step go through each block while its weights
are on the device; gradients add up there. Held against eager accumulation ((loss / k).backward()
k times, then one torch.optim.AdamW step), with the weights fetched once per direction per step."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import megacompile
import megacompile.planner.search as planner
from megacompile.errors import ArgumentError, CheckpointError, InputMismatchError
from megacompile.ir.program import Op
from megacompile.optim import AdamW
from megacompile.passes import ScheduleChoice, StepKind
from megacompile.planner.request import PlanRequest
from megacompile.acceptance.parity import BETAS, EPS, LR, WD, clone, float64_noise, loss_of, make_inputs
from tests import models
from tests.e2e.harness import assert_same_weights

K = 4


def _eager(model, batches, k):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for s in range(0, len(batches), k):
        opt.zero_grad(set_to_none=True)
        for ids in batches[s:s + k]:
            loss = loss_of(model(**make_inputs("llama", ids)))
            (loss / k).backward()
            losses.append(loss.item())
        opt.step()
    return losses


def _layer_major(model, batches, k, **kw):
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=k, accumulation="layer",
                                 optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"), **kw)
    losses, peaks = [], []
    for i, ids in enumerate(batches):
        loss = engine.step(**make_inputs("llama", ids))
        record = engine.last_step
        assert record.lr == LR and record.tokens == ids.numel() and record.seconds > 0
        if i % k < k - 1:
            assert loss is None and not record.updated and record.device_peak_bytes is None
        else:
            assert loss == engine.accumulated_losses[-1] and record.updated
            losses += engine.accumulated_losses
            peaks.append(engine.memory_stats()["device_peak_bytes"])
            assert record.device_peak_bytes == peaks[-1]
            assert record.predicted_device_peak_bytes == engine.plan.predicted_peak_bytes
    engine.synchronize()
    return engine, losses, peaks


def _check(model, batches, **kw):
    reference = clone(model)
    eager = _eager(reference, batches, K)
    engine, losses, peaks = _layer_major(clone(model), batches, K, **kw)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(lambda m: _eager(m, batches, K), model, reference))
    plan = engine.plan
    assert plan.program.facts["micro_batches"] == K
    assert all(p == plan.predicted_peak_bytes for p in peaks)
    # Each stage's weights cross the link at most once per direction in the whole step, and each
    # stage's gradients leave the device once.
    prefetches = Counter(n.stage for n in plan.program.nodes
                         if n.op is Op.PREFETCH and plan.program.values[n.writes[0]].kind == "weights")
    assert max(prefetches.values()) <= 2
    grads_out = Counter(n.stage for n in plan.program.nodes
                        if n.op is Op.OFFLOAD and plan.program.values[n.reads[0]].kind == "grads")
    assert set(grads_out.values()) == {1}
    assert plan.weight_h2d_bytes_per_optimizer_step == plan.weight_h2d_bytes_per_step
    return engine


def test_layer_major_k4_trains_as_eager_accumulation():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=64)
    batches = [models.batch(model.config.vocab_size, 2, 16, seed=i) for i in range(2 * K)]
    engine = _check(model, batches)
    # No fp32 accumulator on the host: the state a one-micro-batch step needs.
    one = planner.place_host_state(engine.plan.captured, torch.float32, 1, None, None)
    accumulating = planner.place_host_state(engine.plan.captured, torch.float32, K, None, None)
    assert engine.host.nbytes == one.ram_bytes < accumulating.ram_bytes


def _forced(blocks, budget, peak_of, seconds_of=None, options=None, exact_of=None, bound=float("inf"), floor_of=None):
    # The first block offloads its saved values, the rest recompute; every block input goes to
    # host memory: each micro-batch's stash and restore must find its own copy.
    recompute, offload = frozenset(blocks[1:]), frozenset(blocks[:1])
    return ScheduleChoice(1, recompute, offload=offload, offload_lag=1,
                          boundary=recompute | offload), 0


def test_layer_major_with_offload_recompute_and_boundaries_trains_exactly(monkeypatch):
    torch.manual_seed(1)
    model = models.hf_llama(layers=4, d=32)
    batches = [models.batch(model.config.vocab_size, 2, 16, seed=10 + i) for i in range(K)]
    monkeypatch.setattr(planner, "solve", _forced)
    engine = _check(model, batches)
    program = engine.plan.program
    stashed = [n.reads[0] for n in program.nodes
               if n.op is Op.OFFLOAD and program.values[n.reads[0]].kind in ("saved", "activation")]
    assert {v.split("@")[1] for v in stashed} == {str(m) for m in range(K)}
    assert any(n.op is Op.RECOMPUTE for n in program.nodes)


def test_auto_takes_the_accumulation_with_the_shorter_predicted_step():
    model = models.hf_llama(layers=2, d=64)
    ids = models.batch(model.config.vocab_size, 1, 8)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=K)
    captured = engine.prepare(**make_inputs("llama", ids)).captured

    def plan(mode):
        return planner.make_plan(captured, PlanRequest(engine.budget_bytes, StepKind(), "cpu", engine.plan.hardware,
                                                       host_bytes=0, grad_accum=K, accumulation=mode))
    micro, layer, auto = plan("micro"), plan("layer"), plan("auto")
    assert micro.program.facts.get("micro_batches", 1) == 1 and layer.program.facts["micro_batches"] == K
    per_step = {"micro": K * micro.prediction.step_s, "layer": layer.prediction.step_s}
    assert auto.program.facts.get("micro_batches", 1) == (K if per_step["layer"] < per_step["micro"] else 1)
    # Weights over the link per optimizer step: k times a micro-batch's for micro-batch-major.
    assert micro.weight_h2d_bytes_per_optimizer_step == K * micro.weight_h2d_bytes_per_step
    assert layer.weight_h2d_bytes_per_optimizer_step < micro.weight_h2d_bytes_per_optimizer_step
    assert layer.to_json()["accumulation"] == "layer-major"


def test_layer_major_refuses_dropout_and_bad_modes():
    model = models.hf_gpt2(layers=2, d=64, dropout=0.1)    # its draws would come in another order than eager's
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=2, accumulation="layer")
    ids = models.batch(model.config.vocab_size, 1, 8)
    with pytest.raises(ArgumentError, match="random ops.*accumulation='micro'"):
        engine.step(input_ids=ids, labels=ids)
    with pytest.raises(ArgumentError, match="accumulation.*'layer'.*got 'rows'"):
        megacompile.compile(model, hbm_budget=1.0, device="cpu", accumulation="rows")


def test_a_layer_major_step_refuses_what_it_cannot_hold(tmp_path):
    """Waiting micro-batches live in the engine only: a checkpoint taken among them would resume
    without them, so it is refused; and one program runs a step's micro-batches, so they share shapes."""
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=64)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=2, accumulation="layer")
    ids = models.batch(model.config.vocab_size, 2, 16)
    assert engine.step(**make_inputs("llama", ids)) is None
    with pytest.raises(CheckpointError, match="1 micro-batches of a layer-major step wait"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(InputMismatchError, match="same shapes"):
        engine.step(**make_inputs("llama", models.batch(model.config.vocab_size, 2, 8)))
    assert engine.step(**make_inputs("llama", ids)) is not None      # the step completes as it began
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "COMMITTED").exists()
    engine.close()
