"""The host-side update the executor calls per stage: AdamW over the fp32 masters, and the
global-norm clip before it.

It runs on the host stream, often after step() has returned, so it reads the step's settings
(lr, betas, eps, weight decay, step number, clip scale) from the context fixed when the step
began (TrainingState.step_context), never from the live param group. It keeps the optimizer and
the host state, never the engine that owns them: a dropped engine is then freed at once, and its
streams end with it.
"""
from __future__ import annotations

from .adamw import AdamW
from .fused_adamw import adamw_update_


class HostUpdate:
    def __init__(self, optimizer: AdamW):
        self.optimizer = optimizer
        self.host = None     # runtime.HostState, set once the engine has built its host state

    def clip(self, context: dict) -> None:
        norm = self.host.grad_sq_norm() ** 0.5
        context["grad_norm"] = norm
        # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), at most 1
        context["grad_scale"] = min(1.0, self.optimizer.max_grad_norm / (norm + 1e-6))

    def adamw(self, stage: int, context: dict) -> None:
        opt = self.optimizer
        beta1, beta2 = context["betas"]

        # step: the parameters' own AdamW step count, the global one less the steps that gave them
        # no gradient; decays: False for those AdamW no_decay names; ratio: their lr's multiple of
        # the step's (AdamW lr_ratios; runtime/host.py schedule_updates).
        def update(master, grad, exp_avg, exp_avg_sq, out, step: int, decays: bool, ratio: float) -> None:
            adamw_update_(master, grad, exp_avg, exp_avg_sq,
                          lr=context["lr"] * ratio, beta1=beta1, beta2=beta2, eps=context["eps"],
                          weight_decay=context["weight_decay"] if decays else 0.0, step=step,
                          grad_scale=context["grad_scale"],
                          out=out, **({"backend": "torch"} if opt.kernel == "torch" else {}))
        self.host.update_owner(stage, update)
