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
    (a schedule); torch LR schedulers attach to `engine.torch_optimizer` instead. Defaults
    match torch.optim.AdamW. `max_grad_norm` clips the global gradient norm first, exactly as
    torch.nn.utils.clip_grad_norm_. `kernel`: "fused" (the native one-pass kernel; a torch
    fallback when no compiler is found) or "torch" (torch's own ops in torch's order, which
    round as torch.optim.AdamW does; slower).
    """
    lr: LearningRate = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None
    kernel: str = "fused"

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise OptimizerInputError(f"AdamW betas must lie in [0, 1), got {self.betas}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise OptimizerInputError(f"AdamW eps must be a positive number, got {self.eps}")
        if self.weight_decay < 0:
            raise OptimizerInputError(f"AdamW weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise OptimizerInputError(f"AdamW max_grad_norm must be > 0 (or None), got {self.max_grad_norm}")
        if self.kernel not in ("fused", "torch"):
            raise OptimizerInputError(f"AdamW kernel must be 'fused' or 'torch', got {self.kernel!r}")
        if not callable(self.lr) and not (self.lr >= 0 and math.isfinite(self.lr)):
            raise OptimizerInputError(f"AdamW lr must be >= 0 or a function of the step, got {self.lr}")

    def lr_at(self, step: int) -> float:
        lr = self.lr(step) if callable(self.lr) else self.lr
        if not (lr >= 0 and math.isfinite(lr)):
            raise OptimizerInputError(f"the learning-rate schedule gave {lr} at step {step}; it must be >= 0")
        return float(lr)
