"""The optimizer a user hands to compile(): AdamW over float32 masters on the host."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Union

from ..errors import OptimizerInputError

LearningRate = Union[float, Callable[[int], float]]


@dataclass(frozen=True)
class AdamW:
    """AdamW as torch.optim.AdamW defines it (decoupled weight decay, bias correction).

    `lr` is a number or a function of the 1-based step that returns the rate for that step
    (a schedule); defaults match torch.optim.AdamW.
    """
    lr: LearningRate = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise OptimizerInputError(f"AdamW betas must lie in [0, 1), got {self.betas}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise OptimizerInputError(f"AdamW eps must be a positive number, got {self.eps}")
        if self.weight_decay < 0:
            raise OptimizerInputError(f"AdamW weight_decay must be >= 0, got {self.weight_decay}")
        if not callable(self.lr) and not (self.lr >= 0 and math.isfinite(self.lr)):
            raise OptimizerInputError(f"AdamW lr must be >= 0 or a function of the step, got {self.lr}")

    def lr_at(self, step: int) -> float:
        lr = self.lr(step) if callable(self.lr) else self.lr
        if not (lr >= 0 and math.isfinite(lr)):
            raise OptimizerInputError(f"the learning-rate schedule gave {lr} at step {step}; it must be >= 0")
        return float(lr)
