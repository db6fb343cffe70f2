"""A torch.optim.Optimizer stand-in, so torch's LR schedulers can drive the host AdamW.

    engine = megacompile.compile(model, 80, optimizer=megacompile.AdamW(lr=3e-4))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(engine.torch_optimizer, T_max=1000)
    for batch in data:
        engine.step(**batch)
        sched.step()

The scheduler writes param_groups[0]["lr"]; each step reads it when the step starts. It holds no
parameters of the model and its step() does nothing: the update runs on the host masters.
"""
from __future__ import annotations

import torch

from .adamw import AdamW


class LearningRateHandle(torch.optim.Optimizer):
    def __init__(self, spec: AdamW):
        lr = spec.lr if not callable(spec.lr) else 0.0
        super().__init__([torch.zeros(0)], {"lr": lr, "betas": spec.betas, "eps": spec.eps,
                                            "weight_decay": spec.weight_decay})
        self.schedule_is_callable = callable(spec.lr)

    def step(self, closure=None):  # noqa: D401 - the host AdamW does the update
        return None
