"""finetuning_type: freeze: the last (or first) N decoder blocks trained, some of their modules,
and modules outside them (LlamaFactory's freeze_* keys); the rest frozen."""
from __future__ import annotations

import torch.nn as nn

from ...errors import ArgumentError
from .names import ALL


def blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the ModuleList of config.num_hidden_layers modules (else the longest)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    wanted = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    fitting = [x for x in lists if len(x[1]) == wanted] or lists
    if not fitting:
        raise ArgumentError(f"{type(model).__name__} has no list of decoder blocks (an nn.ModuleList): "
                            "finetuning_type lora with lora_target all, and freeze, need one")
    return max(fitting, key=lambda x: len(x[1]))


def freeze(model: nn.Module, layers: int, modules: list[str] | str, extra: list[str]) -> None:
    prefix, stack = blocks(model)
    if abs(layers) > len(stack):
        raise ArgumentError(f"freeze_trainable_layers {layers}: {type(model).__name__} has {len(stack)} decoder "
                            f"blocks; give 1..{len(stack)} (the last N) or -{len(stack)}..-1 (the first N)")
    chosen = range(len(stack) - layers, len(stack)) if layers > 0 else range(-layers)
    trained = [f"{prefix}.{i}." for i in chosen]
    params = dict(model.named_parameters())
    in_blocks = {n: n[len(b):] for n in params for b in trained if n.startswith(b)}

    def has(path: str, module: str) -> bool:      # `module` as whole name components of `path`
        return f".{module}." in f".{path}"
    if modules != ALL:
        absent = [m for m in modules if not any(has(rel, m) for rel in in_blocks.values())]
        if absent:
            inside = sorted({n.rsplit(".", 1)[-1] for n, _ in stack[0].named_modules() if n})
            raise ArgumentError(f"freeze_trainable_modules: {', '.join(absent)} names no parameter of the decoder "
                                f"blocks; their modules are {', '.join(inside)} (or all)")
    absent = [m for m in extra if not any(has(n, m) for n in params)]
    if absent:
        outside = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules()
                          if n and not n.startswith(prefix + ".") and n != prefix})
        raise ArgumentError(f"freeze_extra_modules: {', '.join(absent)} names no parameter of "
                            f"{type(model).__name__}; modules outside the blocks are {', '.join(outside)}")
    for name, p in params.items():
        rel = in_blocks.get(name)
        block = rel is not None and (modules == ALL or any(has(rel, m) for m in modules))
        p.requires_grad_(block or any(has(name, m) for m in extra))
