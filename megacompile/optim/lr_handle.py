"""A torch.optim.Optimizer stand-in, so torch's LR schedulers can drive the host AdamW.

    engine = megacompile.compile(model, 80, optimizer=megacompile.AdamW(lr=3e-4))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.torch_optimizer, T_max=1000)
    for batch in data:
        engine.step(**batch)
        sched.step()

Its param_groups[0] holds lr, betas, eps and weight_decay, as torch.optim.AdamW's does; a scheduler
(OneCycleLR also cycles betas[0]) or the user writes them, and each step reads all four when it
starts (a callable AdamW lr gives the rate instead). It holds no parameters of the model and its
step() does nothing: the update runs on the host masters.
"""
from __future__ import annotations

import math

import torch

from ..errors import OptimizerInputError
from .adamw import AdamW, _real


class LearningRateHandle(torch.optim.Optimizer):
    def __init__(self, spec: AdamW):
        lr = spec.lr if not callable(spec.lr) else 0.0
        super().__init__([torch.zeros(0)], {"lr": lr, "betas": spec.betas, "eps": spec.eps,
                                            "weight_decay": spec.weight_decay})
        self.schedule_is_callable = callable(spec.lr)

    def step(self, closure=None):  # noqa: D401 - the host AdamW does the update
        return None

    def settings(self) -> dict:
        """param_groups[0]'s lr, betas, eps and weight_decay as the step will use them, checked: a
        bad value written there is refused when the step starts, before anything runs."""
        group = self.param_groups[0]
        where = "engine.torch_optimizer.param_groups[0]"
        betas = group.get("betas")
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(_real(b) and 0 <= b < 1 for b in betas)):
            raise OptimizerInputError(f"{where}['betas'] must be two numbers in [0, 1), got {betas!r}")
        for key, ok, rule in (("lr", lambda v: v >= 0, ">= 0"), ("eps", lambda v: 0 < v < 1, "in (0, 1)"),
                              ("weight_decay", lambda v: v >= 0, ">= 0")):
            value = group.get(key)
            if not (_real(value) and math.isfinite(value) and ok(value)):
                raise OptimizerInputError(f"{where}[{key!r}] must be a finite number {rule}, got {value!r}")
        return {"lr": float(group["lr"]), "betas": (float(betas[0]), float(betas[1])), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"])}
