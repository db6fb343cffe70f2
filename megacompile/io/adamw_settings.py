"""Another trainer's AdamW settings against this engine's: what an import names when they differ."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import MegacompileError

if TYPE_CHECKING:
    from ..optim import AdamW


def close(a: list, b: list) -> bool:
    """Whether the numbers of `a` are those of `b` (to 1e-12: a float written and read back)."""
    return len(a) == len(b) and all(isinstance(x, (int, float)) and math.isclose(x, y, rel_tol=1e-12, abs_tol=0)
                                    for x, y in zip(a, b))


def betas_and_eps(optimizer: "AdamW", group: dict) -> list[str]:
    """How the param group `group` of a torch AdamW's state differs from `optimizer` in betas and eps."""
    differences = []
    if not close(list(group.get("betas", optimizer.betas)), list(optimizer.betas)):
        differences.append(f"betas: the checkpoint has {list(group['betas'])}, this engine {list(optimizer.betas)}")
    if not close([group.get("eps", optimizer.eps)], [optimizer.eps]):
        differences.append(f"eps: the checkpoint has {group['eps']!r}, this engine {optimizer.eps!r}")
    return differences


def not_adamw(groups: list[dict]) -> list[str]:
    """How the optimizer of the param groups `groups` (torch's, or DeepSpeed's Adam) is not AdamW."""
    for group in groups:
        # torch's Adam (DeepSpeed's with adam_w_mode off) adds its decay to the gradient, AdamW to
        # the update; Adam without bias correction takes its first steps otherwise.
        if group.get("weight_decay") and (group.get("decoupled_weight_decay") is False
                                          or group.get("adamw_mode") is False):
            return ["its optimizer is Adam with L2 weight decay (added to the gradient), not AdamW's decoupled decay"]
        if group.get("bias_correction") is False:
            return ["its Adam ran without bias correction"]
    return []


def settled(differences: list[str], where: str, strict: bool) -> list[str]:
    """The differences `where` (the checkpoint, named) has from this engine: refused when strict,
    else one note that this engine's settings are kept (none when there are none)."""
    if differences and strict:
        raise MegacompileError(f"{where} differs from this engine: {'; '.join(differences)}; nothing was loaded "
                               "(strict=False loads it and keeps this engine's settings)")
    return [f"{where} was saved with other AdamW settings, this engine's are kept: "
            f"{'; '.join(differences)}"] * bool(differences)
