"""The summary's `bound by` line names what sets the pace of a step, from the prediction's waits:
the host's AdamW updates (more tokens a step share them), the host link (a larger budget keeps more
on the device) or compute (planner/step_bound.py)."""
from __future__ import annotations

import types

import torch
import transformers

import megacompile
from megacompile.cost.hardware import PROFILES, replace
from megacompile.cost.predict import StepPrediction
from megacompile.planner.step_bound import bound


def _model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128)
    return transformers.AutoModelForCausalLM.from_config(config)


def _bound(hardware) -> tuple[str, object]:
    plan = megacompile.plan(_model(), hbm_budget=1.0, batch=2, seq=64, hardware=hardware, host_budget=64)
    lines = [line for line in plan.summary().splitlines() if line.startswith("  bound by")]
    assert len(lines) == 1, plan.summary()
    return lines[0], plan.prediction


def test_a_step_waiting_on_its_updates_is_told_to_take_more_tokens_a_step():
    slow_host = replace(PROFILES["h100"], host_adam_params_per_s=1e6, host_bw=28e6)
    line, p = _bound(slow_host)
    assert p.exposed_update_s > 0.5 * p.step_s
    assert "the host's AdamW updates" in line and "--global-batch N" in line and "does not shorten it" in line
    assert ("host AdamW's rate (0.001e9 parameters/s, moving 0.028 GB/s of its 28 B a parameter; --host and "
            "--host-cores") in line


def test_a_step_waiting_on_the_link_is_told_to_keep_more_on_the_device():
    slow_link = replace(PROFILES["h100"], h2d_bw=1e6, d2h_bw=1e6)
    line, p = _bound(slow_link)
    assert p.exposed_transfer_s > 0.5 * p.step_s
    assert "the host link" in line and "--hbm-budget" in line and "0.001 GB/s each way" in line


def test_a_step_without_waits_is_compute_bound():
    fast = replace(PROFILES["h100"], h2d_bw=1e15, d2h_bw=1e15, host_adam_params_per_s=1e15, host_bw=1e15)
    line, p = _bound(fast)
    assert p.exposed_s < 0.1 * p.step_s
    assert line.startswith("  bound by       compute:") and "of its 989 TFLOPS peak" in line


def test_a_host_busy_through_the_step_beside_the_backward_is_what_bounds_it():
    """Updates started as their gradients land overlap the backward: the compute thread waits on the
    link or on nothing, while the host's updates fill the step (a 70B on an H200 host: 14.4 s of a
    14.7 s step). The updates set the pace, not the link: a larger budget would not shorten it."""
    def plan(host_s: float):
        p = StepPrediction(step_s=14.7, compute_s=12.0, exposed_s=2.5, h2d_s=9.0, d2h_s=4.0, host_s=host_s,
                           hardware_flops=1.0, model_flops=1.0, tokens=16384, exposed_update_s=0.1)
        return types.SimpleNamespace(prediction=p, captured=types.SimpleNamespace(train=True), host_cost=None,
                                     hardware=PROFILES["h200"], grad_accum=1, disk_sets_pace=False)
    what, advice = bound(plan(14.39))
    assert what.startswith("the host's AdamW updates: busy 14.4 s of the 14.7 s (98%), beside the backward")
    assert "5.36e9 parameters/s, moving 150 GB/s" in what and "does not shorten it" in advice
    what, advice = bound(plan(8.0))         # a host with room to spare: the link's wait sets the pace
    assert what.startswith("the host link: 2.4 s of the 14.7 s waits on copies") and "--hbm-budget" in advice
