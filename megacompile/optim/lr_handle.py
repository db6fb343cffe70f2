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

state_dict() and load_state_dict() carry the host AdamW's moments and step counts as
torch.optim.AdamW's do, so torch's resume idiom (torch.save of engine.state_dict() and this) goes
on exactly (io/torch_adamw_state.py does the reading and writing). It has the one param group:
add_param_group is refused, as the host AdamW has no groups (AdamW no_decay and lr_ratios).
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
        # What reads and writes the engine's moments (io/torch_adamw_state.py); None: no engine.
        self._adamw_state = None
        self._made = True      # torch.optim.Optimizer.__init__ adds the one group through add_param_group

    def step(self, closure=None):  # noqa: D401 - the host AdamW does the update
        return None

    def hold_state(self, adamw_state) -> None:
        """Serve state_dict() and load_state_dict() from `adamw_state` (state_dict(group) and
        load_state_dict(saved, check_group)): the engine's moments."""
        self._adamw_state = adamw_state

    def state_dict(self) -> dict:
        """torch.optim.AdamW's state_dict of the host AdamW: per parameter index (model.parameters()
        order) its step, exp_avg and exp_avg_sq, and the param group."""
        return self._served("state_dict").state_dict(self.param_groups[0])

    def load_state_dict(self, state_dict: dict) -> None:
        """Put a torch.optim.AdamW state_dict (this one's, or an eager optimizer's over
        model.parameters()) back: moments, step counts and the param group's settings, every one
        checked before anything changes."""
        group = self._served("load_state_dict").load_state_dict(state_dict, self._checked_group)
        self.param_groups[0].update(group)

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_made", False):
            super().add_param_group(param_group)
            return
        raise OptimizerInputError(
            "engine.torch_optimizer.add_param_group: the host AdamW steps every trainable parameter in one group, "
            "whose lr, betas, eps and weight_decay are param_groups[0]'s. Give parameters weight decay 0 with "
            "megacompile.AdamW(no_decay=[names]), an lr that is a multiple of the rest with "
            "megacompile.AdamW(lr_ratios={name: ratio}), both passed to compile(); freeze a parameter (lr 0) with "
            "param.requires_grad_(False) before compile()")

    def _served(self, what: str):
        if self._adamw_state is None:
            raise OptimizerInputError(f"{what}: this LR handle belongs to no engine; use engine.torch_optimizer")
        return self._adamw_state

    def settings(self) -> dict:
        """param_groups[0]'s lr, betas, eps and weight_decay as the step will use them, checked: a
        bad value written there is refused when the step starts, before anything runs."""
        return self._checked_group(self.param_groups[0], "engine.torch_optimizer.param_groups[0]")

    @staticmethod
    def _checked_group(group: dict, where: str) -> dict:
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
