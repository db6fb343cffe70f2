"""What compile() says when given a torch optimizer: its param groups, and the megacompile.AdamW
that steps the same parameters the same way, where there is one.

torch.optim.AdamW's usual groups differ in weight decay (a group at 0: biases and norms) and in
lr (a multiple of one base lr: LoRA+). The host AdamW is one optimizer over every trainable
parameter, with those two differences named per parameter: `no_decay` (weight decay 0) and
`lr_ratios` (lr x a ratio). Groups that differ otherwise (betas, eps, two non-zero decays, lr 0)
have no such AdamW, and the message says which.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .lr_ratio import MAX_RATIO
from .weight_decay import hf_no_decay


def advice(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> str:
    """The megacompile.AdamW(...) to pass instead of `optimizer`, or why there is none."""
    groups = optimizer.param_groups
    g = groups[0]
    if len(groups) == 1:
        return (f"pass megacompile.AdamW(lr={g.get('lr')!r}, betas={tuple(g.get('betas', (0.9, 0.999)))!r}, "
                f"eps={g.get('eps')!r}, weight_decay={g.get('weight_decay')!r})")
    listed = "; ".join(f"group {i}: {len(x['params'])} parameters, lr {x.get('lr')!r}, weight_decay "
                       f"{x.get('weight_decay')!r}, betas {tuple(x.get('betas', ()))!r}, eps {x.get('eps')!r}"
                       for i, x in enumerate(groups))
    head = f"its {len(groups)} param groups ({listed})"
    # the base lr: the optimizer's default where a group runs at it (the usual recipe), else group 0's
    base = next((x for x in groups if x.get("lr") == optimizer.defaults.get("lr")), g)
    why_not = _not_expressible(groups, base)
    if why_not:
        return (f"{head} cannot be one megacompile.AdamW: {why_not}. megacompile.AdamW steps every trainable "
                "parameter alike but for no_decay (weight decay 0) and lr_ratios (lr x a ratio)")
    if model is None:
        return (f"{head} are megacompile.AdamW(no_decay=[names], lr_ratios={{name: ratio}}) by parameter name: "
                "give the optimizer to compile(model, ...) to have them written out")
    names = {id(p): n for n, p in model.named_parameters()}
    decay = max(x.get("weight_decay", 0) for x in groups)
    no_decay = [names.get(id(p), "?") for x in groups if x.get("weight_decay", 0) == 0 and decay > 0
                for p in x["params"]]
    ratios = {names.get(id(p), "?"): x["lr"] / base["lr"] for x in groups if x["lr"] != base["lr"]
              for p in x["params"]}
    grouped = {id(p) for x in groups for p in x["params"]}
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in grouped]
    no_decay_arg = ("megacompile.hf_no_decay" if no_decay and set(no_decay) == set(hf_no_decay(model))
                    else repr(no_decay))
    betas = tuple(base.get("betas", (0.9, 0.999)))
    same = (f"megacompile.AdamW(lr={base['lr']!r}, betas={betas!r}, eps={base['eps']!r}, weight_decay={decay!r}"
            + (f", no_decay={no_decay_arg}" if no_decay else "")
            + (f", lr_ratios={ratios!r}" if ratios else "") + ")")
    return (f"{head} are, exactly, {same}"
            + (f"; {len(left)} trainable parameters in no group ({', '.join(left[:3])}) would train too: freeze "
               "them with requires_grad_(False) before compile()" if left else ""))


def _not_expressible(groups: list[dict], base: dict) -> str:
    """Why the groups are no one megacompile.AdamW, or ''."""
    for key in ("betas", "eps", "amsgrad", "maximize"):
        values = {tuple(x.get(key, ())) if key == "betas" else x.get(key) for x in groups}
        if len(values) > 1:
            return f"their {key} differ ({', '.join(map(repr, values))})"
    if any(x.get("amsgrad") or x.get("maximize") for x in groups):
        return "amsgrad or maximize is set, which the host AdamW does not run"
    decays = {x.get("weight_decay", 0) for x in groups} - {0}
    if len(decays) > 1:
        return f"they decay at {len(decays)} rates other than 0 ({', '.join(map(repr, sorted(decays)))})"
    lrs = [x["lr"] for x in groups]
    if any(not isinstance(lr, (int, float)) for lr in lrs):
        return "an lr is not a number"
    if any(lr <= 0 for lr in lrs):
        return "a group has lr 0 (freeze its parameters with requires_grad_(False) before compile() instead)"
    if any(lr / base["lr"] > MAX_RATIO for lr in lrs):
        return f"a group's lr is more than {MAX_RATIO:g} times the base lr {base['lr']!r} (lr_ratios' bound)"
    return ""
