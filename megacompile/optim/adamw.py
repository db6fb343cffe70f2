"""The optimizer a user hands to compile(): AdamW over float32 masters on the host."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Union

import torch

from ..errors import ArgumentError, OptimizerInputError
from .lr_ratio import LrRatios, check_lr_ratios
from .weight_decay import NoDecay, check_no_decay

LearningRate = Union[float, Callable[[int], float]]
# AdamW moves each weight by about lr a step (the update is lr * m / sqrt(v), |m / sqrt(v)| <= ~1):
# above 1 no training is meant, and 1e30 is a typo, caught before the first step.
MAX_LR = 1.0


def _lr_ok(lr: object) -> bool:
    return _real(lr) and 0 <= lr <= MAX_LR


@dataclass(frozen=True)
class AdamW:
    """AdamW as torch.optim.AdamW defines it (decoupled weight decay, bias correction).

    `lr` is a number or a function of the 1-based step that returns the rate for that step
    (a schedule); torch LR schedulers attach to `engine.torch_optimizer` instead. Defaults
    match torch.optim.AdamW. `max_grad_norm` clips the global gradient norm first, exactly as
    torch.nn.utils.clip_grad_norm_; `math.inf` measures the norm (engine.last_step.grad_norm)
    and never clips, as clip_grad_norm_(max_norm=inf) does. `kernel`: "fused" (the native one-pass kernel; a torch
    fallback when no compiler is found) or "torch" (torch's own ops in torch's order, which
    round as torch.optim.AdamW does; slower). `no_decay`: the parameters stepped with weight decay 0
    (torch.optim.AdamW's second param group in the usual recipe): their names as
    model.named_parameters() spells them, or a function of the model that returns them, such as
    megacompile.hf_no_decay (Hugging Face Trainer's biases and norm weights); checked against the
    model by compile(). Default: none, every parameter decays (torch.optim.AdamW's meaning).
    `lr_ratios`: {parameter name: ratio}, or a function of the model that returns it: each named
    parameter steps at lr x its ratio (torch.optim.AdamW's param groups of lrs that are multiples
    of one, as LoRA+ makes them; a schedule scales them all alike). Default: every one at lr.
    """
    lr: LearningRate = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None
    kernel: str = "fused"
    no_decay: NoDecay = frozenset()
    lr_ratios: LrRatios = ()

    def __post_init__(self) -> None:
        betas = self.betas
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_real(b) and 0.0 <= b < 1.0 for b in betas)):
            raise OptimizerInputError(f"AdamW betas must be two numbers in [0, 1), e.g. (0.9, 0.999); got {betas!r}")
        if not (_real(self.eps) and 0 < self.eps < 1):
            raise OptimizerInputError(f"AdamW eps must be a number in (0, 1), e.g. 1e-8, got {self.eps!r}")
        if not (_real(self.weight_decay) and 0 <= self.weight_decay < math.inf):
            raise OptimizerInputError(f"AdamW weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not callable(self.lr) and _lr_ok(self.lr) and self.lr * self.weight_decay >= 1:
            raise OptimizerInputError(f"AdamW weight_decay {self.weight_decay!r} with lr {self.lr!r} multiplies each "
                                      "weight by 1 - lr * weight_decay <= 0 a step, erasing or flipping it; give "
                                      "lr * weight_decay < 1 (weight_decay is usually 0 to 0.1)")
        if self.max_grad_norm is not None and not (_real(self.max_grad_norm) and 0 < self.max_grad_norm <= math.inf):
            raise OptimizerInputError(f"AdamW max_grad_norm must be a number > 0 (inf measures the norm without "
                                      f"clipping; None neither measures nor clips), "
                                      f"got {self.max_grad_norm!r}")
        if self.kernel not in ("fused", "torch"):
            raise OptimizerInputError(f"AdamW kernel must be 'fused' or 'torch', got {self.kernel!r}")
        if not callable(self.lr) and not _lr_ok(self.lr):
            raise OptimizerInputError(f"AdamW lr must be a number in [0, {MAX_LR:g}] (each step moves every weight "
                                      f"by about lr) or a function of the step, got {self.lr!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        object.__setattr__(self, "no_decay", check_no_decay(self.no_decay))
        object.__setattr__(self, "lr_ratios", check_lr_ratios(self.lr_ratios))
        top = max((r for _, r in self.lr_ratios), default=1.0) if isinstance(self.lr_ratios, tuple) else 1.0
        if not callable(self.lr) and self.lr * top > MAX_LR:
            raise OptimizerInputError(f"AdamW lr_ratios steps a parameter at lr {self.lr!r} x {top:g} = "
                                      f"{self.lr * top:g}, above {MAX_LR:g} (each step moves a weight by about its "
                                      "lr): give smaller ratios or a smaller lr")

    def lr_at(self, step: int) -> float:
        lr = self.lr(step) if callable(self.lr) else self.lr
        if not _lr_ok(lr):
            raise OptimizerInputError(f"the learning-rate schedule gave {lr} at step {step}; it must be a number in "
                                      f"[0, {MAX_LR:g}]")
        return float(lr)


def check_step_lr(lr: float, weight_decay: float, top_ratio: float, step: int) -> None:
    """The lr one step runs at (a schedule's, or what was written into the LR handle's param group),
    bounded as a constant lr is when AdamW is made: refused before the step runs, so that no
    master moves by more than MAX_LR and no decay erases a weight."""
    where = f"step {step} runs at lr {lr:g}"
    if lr > MAX_LR:
        raise OptimizerInputError(f"{where}, above {MAX_LR:g} (each step moves every weight by about lr): the schedule "
                                  "or engine.torch_optimizer.param_groups[0]['lr'] gave it; nothing was updated")
    if lr * top_ratio > MAX_LR:
        raise OptimizerInputError(f"{where}, and lr_ratios steps a parameter at {top_ratio:g} x that = "
                                  f"{lr * top_ratio:g}, above {MAX_LR:g} (each step moves a weight by about its lr): "
                                  "give smaller ratios or a smaller schedule; nothing was updated")
    if lr * weight_decay >= 1:
        raise OptimizerInputError(f"{where} with weight_decay {weight_decay:g}: AdamW multiplies each weight by "
                                  f"1 - lr * weight_decay = {1 - lr * weight_decay:g}, erasing or flipping it; give "
                                  "lr * weight_decay < 1; nothing was updated")


def _real(x: object) -> bool:
    """A real number, not a bool (True would read as 1) nor a string."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def given_optimizer(value, model: torch.nn.Module | None = None) -> AdamW:
    """compile()'s and plan()'s `optimizer`: megacompile.AdamW, or None for its defaults. A torch
    optimizer holds the module's own parameters, which the engine does not update: it is refused,
    with the AdamW to write instead (its param groups as no_decay and lr_ratios, named by `model`'s
    parameters where it is given: torch_groups.py)."""
    if value is None:
        return AdamW()
    if isinstance(value, AdamW):
        return value
    if isinstance(value, torch.optim.Optimizer):
        from .torch_groups import advice
        raise ArgumentError(f"optimizer takes a megacompile.AdamW, got a {type(value).__module__}."
                            f"{type(value).__name__}: the host AdamW updates megacompile's fp32 masters, not "
                            f"the module's parameters; {advice(value, model)} (torch LR schedulers attach to "
                            "engine.torch_optimizer)")
    raise ArgumentError(f"optimizer takes a megacompile.AdamW (or None), got {type(value).__name__}")
