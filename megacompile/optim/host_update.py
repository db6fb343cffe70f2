"""The host-side update the executor calls per stage: AdamW over the fp32 masters, and the
global-norm clip before it.

It runs on the host stream, often after step() has returned, so it reads the step's settings
(lr, step number, clip scale) from the context fixed when the step began, never from the live
optimizer fields. It keeps the optimizer and the host state, never the engine that owns them: a
dropped engine is then freed at once, and its streams end with it.
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

        # step: the parameters' own AdamW step count, the global one less the steps that gave them
        # no gradient (runtime/host.py schedule_updates).
        def update(master, grad, exp_avg, exp_avg_sq, out, step: int) -> None:
            adamw_update_(master, grad, exp_avg, exp_avg_sq,
                          lr=context["lr"], beta1=opt.betas[0], beta2=opt.betas[1], eps=opt.eps,
                          weight_decay=opt.weight_decay, step=step, grad_scale=context["grad_scale"],
                          out=out, **({"backend": "torch"} if opt.kernel == "torch" else {}))
        self.host.update_owner(stage, update)
