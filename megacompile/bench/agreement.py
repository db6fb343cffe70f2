"""Do all systems train the same model on the same data? Their losses, step by step, against a
reference row's, within the tolerance of the compute dtype."""
from __future__ import annotations

import math

# bf16 compute rounds differently in every system (kernels, reduction orders): the losses of the
# same model on the same data agree to about 1e-3 relative over a few steps, never near 2e-2.
BF16_LOSS_RTOL = 2e-2
# fp32 compute (the cpu half): systems differ only in the order of their sums.
FP32_LOSS_RTOL = 1e-4


def loss_deviation(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference, step by step; inf when the runs differ in length or are not finite."""
    if len(losses) != len(reference) or not losses:
        return math.inf
    worst = 0.0
    for a, b in zip(losses, reference):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    return worst


def agree(losses: list[float], reference: list[float], rtol: float) -> tuple[bool, float]:
    deviation = loss_deviation(losses, reference)
    return deviation <= rtol, deviation


def loss_fall(losses: list[float]) -> float:
    """How far the loss fell over a run, relative to where it began: agreement within a tolerance
    says something only about losses that moved by well more than it."""
    if len(losses) < 2 or not all(math.isfinite(x) for x in losses):
        return math.nan
    return (losses[0] - losses[-1]) / max(abs(losses[0]), 1e-12)
