"""Models megacompile cannot train exactly yet, refused before tracing with the reason.

docs/families.md lists them. A refusal names the module that triggers it.
"""
from __future__ import annotations

import re

import torch.nn as nn

from ..errors import CaptureError

# Mixture-of-experts layers: Hugging Face runs the experts through torch._grouped_mm (no float32
# under fake tensors) or through a per-expert loop over the tokens each expert got (shapes that
# depend on the routing, which fake tensors cannot know); its batched variant traces but does not
# match eager training to 1e-5.
_MOE = re.compile(r"(Experts|MoE|Moe)(?![a-z])")


def refuse_unsupported(model: nn.Module) -> None:
    for path, module in model.named_modules():
        name = type(module).__name__
        if _MOE.search(name):
            raise CaptureError(
                f"'{path}' ({name}) is a mixture-of-experts layer, which megacompile cannot capture yet: "
                "Hugging Face runs its experts through torch._grouped_mm or a loop whose shapes depend on "
                "the routing. megacompile trains dense decoders (docs/families.md lists the families)")
