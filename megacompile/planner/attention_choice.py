"""Which attention a fused plan runs where torch traces cuDNN's: the one whose plan is faster.

torch 2.10 and later trace scaled_dot_product_attention on sm90 and sm100 cards (with a cuDNN
past 9.15, as torch 2.11's CUDA 13 wheels load) as cuDNN's op, which the fusion does not rewrite
(fusion/attention.py). cuDNN's kernels are faster per FLOP (the H200's calibration: 0.67 of the
matmul rate, against 0.39 for megacompile's attention kernel), but their backward asks the
caching allocator for scratch the plan keeps free in its reserve (a float32 dq and the three
gradients: 642 MiB at the Llama-2-7B shape, 4 x 4096 tokens). Under a tight budget that room is
the prefetches' overlap (the 7B shape at 4.27 GiB, calibrated: 2.99 s a step with cuDNN's op,
2.63 s with the kernel); in long sequences with room to spare the faster kernel wins (at 4 x 16384
tokens in 70 GiB: 6.83 s against 9.27 s). So a fused plan whose capture holds cuDNN's op is made
twice, as traced and from a capture that records FlashAttention's op (capture/flash_attention.py,
which the fusion takes), and the faster plan that fits runs. A capture without a GPU records the
CPU's FlashAttention op: a plan made there is the second, never faster than the GPU's choice.
"""
from __future__ import annotations

from typing import Callable

from ..capture import CapturedModel
from ..errors import BudgetTooSmallError
from .result import Plan


def records_cudnn_attention(captured: CapturedModel) -> bool:
    """The capture runs torch's cuDNN attention op somewhere."""
    templates = {id(st.template): st.template for st in captured.stages}.values()
    return any(n.op == "call_function" and "cudnn_attention" in str(n.target)
               for t in templates for program in (t.forward, t.backward) if program is not None
               for n in program.gm.graph.nodes)


def faster_attention_plan(plan_of: Callable[[CapturedModel], Plan], captured: CapturedModel,
                          flash: Callable[[], CapturedModel] | None) -> Plan:
    """plan_of(captured); where `flash` is given (the plan is fused) and `captured` holds cuDNN's
    attention, also plan_of(flash()), and the one of the two that fits and predicts the shorter
    step. BudgetTooSmallError, naming the smaller of their smallest budgets, when neither fits."""
    if flash is None or not records_cudnn_attention(captured):
        return plan_of(captured)
    plans, refusals = [], []
    for make in (flash, lambda: captured):     # on a tie, the kernel's: the plan made without a GPU
        try:
            plans.append(plan_of(make()))
        except BudgetTooSmallError as refused:
            refusals.append(refused)
    if not plans:
        raise min(refusals, key=lambda e: e.minimum_bytes)
    return min(plans, key=lambda p: p.prediction.step_s if p.prediction is not None else float("inf"))
