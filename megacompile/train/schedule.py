"""Learning-rate schedules: a function of the 1-based optimizer step, for megacompile.AdamW(lr=...)."""
from __future__ import annotations

import math
from typing import Callable


def learning_rate(lr: float, schedule: str, warmup: int, min_lr: float, steps: int) -> Callable[[int], float]:
    """Linear warmup from lr / warmup to lr over `warmup` steps, then `schedule`: constant (lr),
    linear (lr down to min_lr) or cosine (half a cosine from lr to min_lr). The decay starts at lr
    on the first step after warmup and would reach min_lr one step after the last (as
    transformers' schedules do): the last step does not train at a rate of 0."""
    def at(step: int) -> float:
        if step <= warmup:
            return lr * step / warmup
        if schedule == "constant":
            return lr
        progress = min(1.0, (step - 1 - warmup) / max(1, steps - warmup))
        if schedule == "linear":
            return lr + (min_lr - lr) * progress
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return at


def warmup_steps(warmup: int | float, steps: int) -> int:
    """run.yaml's warmup as steps: a float below 1 is a fraction of the run's steps, rounded up
    (transformers' warmup_ratio: ceil(steps * ratio))."""
    return math.ceil(steps * warmup) if isinstance(warmup, float) else warmup
