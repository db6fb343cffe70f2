"""A fused plan where torch traces cuDNN's attention runs the faster of cuDNN's op and the kernel.

torch 2.11 on an H100 or H200 (cuDNN past 9.15) traces scaled_dot_product_attention as
`_scaled_dot_product_cudnn_attention`, which the fusion leaves as ATen, with its backward's op
scratch kept free in the reserve. planner/attention_choice.py plans it also from a capture with
FlashAttention's op, which the fusion takes, and keeps the faster. Without a GPU, torch's choice
there is stood in for by a function that picks as it does (both GPU ops have meta kernels, so they
trace on fake CPU tensors).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import dataclasses

import pytest

import megacompile
from megacompile.capture.flash_attention import flash_attention
from megacompile.errors import BudgetTooSmallError
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.planner import attention_choice
from megacompile.planner.attention_choice import faster_attention_plan
from megacompile.planner.from_config import hardware_profile

aten = torch.ops.aten
CONFIG = LlamaConfig(vocab=64, dim=64, ffn=128, heads=4, kv_heads=4, layers=2)


def _sdpa_as_on_hopper(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's choice on sm90 with cuDNN past 9.15: cuDNN's op while it is enabled, else FlashAttention's."""
    assert attn_mask is None and not enable_gqa
    if torch.backends.cuda.cudnn_sdp_enabled():
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _attention_targets(plan) -> set[str]:
    return {getattr(n.target, "kernel", None) or str(n.target) for stage in plan.captured.stages
            for program in (stage.template.forward, stage.template.backward) if program is not None
            for n in program.gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)}


def _plan(fuse: bool, hardware="h100", seq: int = 32):
    with torch.device("meta"):
        model = TinyLlama(CONFIG)
    return megacompile.plan(model, 1.0, hardware=hardware, batch=2, seq=seq, fuse=fuse)


def test_at_the_same_rate_a_fused_plan_takes_the_attention_kernel_and_frees_the_scratch(monkeypatch):
    """The h100 datasheet times both attentions alike: the kernel's plan keeps no op scratch free
    for cuDNN's backward, and is the faster (or, tied, the one a plan made without a GPU shows)."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_as_on_hopper)
    plan = _plan(fuse=True)
    targets = _attention_targets(plan)
    assert not any("cudnn" in t for t in targets), targets
    assert {"attention", "attention_backward"} <= targets
    assert "attention" not in plan.reserve.scratch_op
    assert plan.attention == "kernel"
    assert plan.summary().splitlines()[0].endswith("fp32 masters, fused kernels)")
    assert torch.backends.cuda.cudnn_sdp_enabled()       # set back after the capture


def test_where_cudnn_is_the_faster_a_fused_plan_keeps_it(monkeypatch):
    """A card on which megacompile's kernel runs at a tenth of cuDNN's rate, in sequences long enough
    for attention to count, with room to spare: cuDNN's op stays, and the rest is fused."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_as_on_hopper)
    h100 = hardware_profile("h100")
    slow_kernel = dataclasses.replace(h100, fused_attention_efficiency=h100.attention_efficiency / 10)
    plan = _plan(fuse=True, hardware=slow_kernel, seq=4096)
    targets = _attention_targets(plan)
    assert "aten._scaled_dot_product_cudnn_attention_backward.default" in targets
    assert "attention_backward" not in targets
    assert plan.attention == "cudnn" and plan.fused
    assert "fp32 masters, fused kernels with cuDNN's attention)" in plan.summary().splitlines()[0]


class _Planned:
    def __init__(self, step_s: float):
        self.prediction = type("Prediction", (), {"step_s": step_s})()


def test_the_choice_keeps_the_faster_plan_that_fits(monkeypatch):
    monkeypatch.setattr(attention_choice, "records_cudnn_attention", lambda c: c == "cudnn")
    fast, slow = _Planned(1.0), _Planned(2.0)
    assert faster_attention_plan({"cudnn": slow, "flash": fast}.get, "cudnn", lambda: "flash") is fast
    assert faster_attention_plan({"cudnn": fast, "flash": slow}.get, "cudnn", lambda: "flash") is fast

    def only(fits: str, minimum: dict):
        def plan_of(c):
            if c != fits:
                raise BudgetTooSmallError(f"{c} does not fit", minimum[c])
            return fast
        return plan_of
    assert faster_attention_plan(only("flash", {"cudnn": 5}), "cudnn", lambda: "flash") is fast
    assert faster_attention_plan(only("cudnn", {"flash": 5}), "cudnn", lambda: "flash") is fast
    with pytest.raises(BudgetTooSmallError, match="flash") as refused:
        faster_attention_plan(only("none", {"cudnn": 7, "flash": 5}), "cudnn", lambda: "flash")
    assert refused.value.minimum_bytes == 5


def test_a_capture_without_cudnns_op_is_planned_once(monkeypatch):
    monkeypatch.setattr(attention_choice, "records_cudnn_attention", lambda c: False)
    calls = []
    plan = faster_attention_plan(lambda c: calls.append(c) or _Planned(1.0), "flash-on-cpu",
                                 lambda: pytest.fail("captured again"))
    assert calls == ["flash-on-cpu"] and plan.prediction.step_s == 1.0


def test_an_unfused_plan_keeps_torchs_choice(monkeypatch):
    """The calibration times torch's attention as torch picks it."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_as_on_hopper)
    plan = _plan(fuse=False)
    assert "aten._scaled_dot_product_cudnn_attention_backward.default" in _attention_targets(plan)
    assert plan.attention == "cudnn"
    assert plan.summary().splitlines()[0].endswith("fp32 masters)")


def test_the_cudnn_flag_is_set_back_as_it_was():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for given in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(given)
            with flash_attention():
                assert not torch.backends.cuda.cudnn_sdp_enabled()
            assert torch.backends.cuda.cudnn_sdp_enabled() is given
            with flash_attention(wanted=False):
                assert torch.backends.cuda.cudnn_sdp_enabled() is given
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
