"""Learning-rate schedules: a function of the 1-based optimizer step, for megacompile.AdamW(lr=...)."""
from __future__ import annotations

import math
from typing import Callable


def learning_rate(lr: float, schedule: str, warmup: int, min_lr: float, steps: int) -> Callable[[int], float]:
    """Linear warmup from lr / warmup to lr over `warmup` steps, then `schedule` until `steps`:
    constant (lr), linear (lr down to min_lr) or cosine (half a cosine from lr to min_lr)."""
    def at(step: int) -> float:
        if step <= warmup:
            return lr * step / warmup
        if schedule == "constant":
            return lr
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        if schedule == "linear":
            return lr + (min_lr - lr) * progress
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return at
