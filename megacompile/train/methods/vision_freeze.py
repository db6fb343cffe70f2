"""Which parts of a vision-language model train: LlamaFactory's `freeze_vision_tower`,
`freeze_multi_modal_projector` and `freeze_language_model`.

A key set to true freezes its part after finetuning_type chose what trains (full: everything,
freeze: some decoder blocks); unset or false leaves that choice alone. Unlike LlamaFactory, whose
defaults freeze the tower and the projector, an unset key freezes nothing: a run without them
trains what it trained before (set `freeze_vision_tower: true` and `freeze_multi_modal_projector:
true` for LlamaFactory's defaults). Under finetuning_type lora the adapters go on the language
model's Linear modules alone and every base weight is frozen: the keys may only say so.

The parts are found by the module names transformers gives them: the vision tower
(`vision_tower`, `vision_model`), the projector (`multi_modal_projector`, `connector`), the
language model (`language_model`, `text_model`) and the head (`lm_head`), which trains with the
language model.
"""
from __future__ import annotations

import torch.nn as nn

from ...errors import ArgumentError

KEYS = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model")
PARTS = {"freeze_vision_tower": ("vision_tower", "vision_model"),
         "freeze_multi_modal_projector": ("multi_modal_projector", "connector"),
         "freeze_language_model": ("language_model", "text_model", "lm_head")}
# What finetuning_type lora holds each key to: the tower and projector frozen, adapters on the language model.
UNDER_LORA = {"freeze_vision_tower": True, "freeze_multi_modal_projector": True, "freeze_language_model": False}


def check(c, adapters: bool) -> None:
    """The keys' values on the RunConfig `c`: unset (None), true or false; `adapters`: the run trains
    LoRA adapters (methods.adapters)."""
    for key in KEYS:
        value = getattr(c, key)
        if value is not None and not isinstance(value, bool):
            raise ArgumentError(f"{key} must be true or false (a vision-language model's part frozen or not); got "
                                f"{value!r}")
    if adapters:
        against = [k for k in KEYS if getattr(c, k) is not None and getattr(c, k) != UNDER_LORA[k]]
        if against:
            raise ArgumentError(f"{', '.join(f'{k}: {str(getattr(c, k)).lower()}' for k in against)}: finetuning_type "
                                "lora puts adapters on the language model and freezes the vision tower and the "
                                "projector; use finetuning_type full (with freeze_* keys) to train those parts")


def given(c) -> dict:
    """The keys this run set, for the checkpoint: a run that sets none keeps what it saved before."""
    return {k: getattr(c, k) for k in KEYS if getattr(c, k) is not None}


def is_vision_language(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def part_of(name: str) -> str | None:
    """The key whose part holds the parameter or module `name`, or None."""
    components = name.split(".")
    for key, modules in PARTS.items():
        if any(m in components for m in modules):
            return key
    return None


def language_model_names(model: nn.Module, names: list[str]) -> list[str]:
    """The full names of the language model's modules whose last name is one of `names` (LoRA's
    targets on a vision-language model: the tower has q_proj and the like too)."""
    return [n for n, _ in model.named_modules()
            if n.rsplit(".", 1)[-1] in names and part_of(n) == "freeze_language_model"]


def apply(c, model: nn.Module) -> None:
    """Freeze the parts whose key is true (in place); on a model without a vision tower, refuse
    any key given."""
    set_keys = [k for k in KEYS if getattr(c, k) is not None]
    if not set_keys:
        return
    if not is_vision_language(model):
        raise ArgumentError(f"{', '.join(set_keys)} {'applies' if len(set_keys) == 1 else 'apply'} to a "
                            f"vision-language model; {type(model).__name__} has no vision tower: leave "
                            f"{'it' if len(set_keys) == 1 else 'them'} out")
    params = dict(model.named_parameters())
    for key in set_keys:
        found = [n for n in params if part_of(n) == key]
        if not found:
            raise ArgumentError(f"{key}: {type(model).__name__} has no module named "
                                f"{' or '.join(PARTS[key])}; its top modules are "
                                f"{', '.join(sorted({n.split('.')[1] if n.startswith('model.') else n.split('.')[0] for n in params}))}")
        if getattr(c, key):
            for n in found:
                params[n].requires_grad_(False)
