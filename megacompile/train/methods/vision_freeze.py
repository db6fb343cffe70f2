"""Which parts of a vision-language model train: LlamaFactory's `freeze_vision_tower`,
`freeze_multi_modal_projector` and `freeze_language_model`.

A key set to true freezes its part after finetuning_type chose what trains (full: everything,
freeze: some decoder blocks); unset or false leaves that choice alone. Unlike LlamaFactory, whose
defaults freeze the tower and the projector, an unset key freezes nothing: a run without them
trains what it trained before (set `freeze_vision_tower: true` and `freeze_multi_modal_projector:
true` for LlamaFactory's defaults). Under finetuning_type lora the adapters go on the language
model's Linear modules alone and every base weight is frozen: the keys may only say so.

The parts are found by the module names transformers gives them (whole name components, under
any prefix: `model.`, PEFT's `base_model.model.`):

    family                tower                          projector                language model
    LLaVA, Gemma 3,       vision_tower                   multi_modal_projector    language_model, lm_head
    PaliGemma, Mllama     (Mllama: vision_model)
    Idefics3, SmolVLM,    vision_model                   connector                text_model, lm_head
    Idefics2
    Qwen2-VL, Qwen2.5-VL  visual (patch_embed, blocks)   visual.merger            language_model, lm_head
    Qwen3-VL (-MoE)       visual (pos_embed, patch_embed, blocks, deepstack_merger_list)
                                                         visual.merger            language_model, lm_head

Qwen's projector sits inside its tower (`visual.merger`): the longer name wins, so the merger is
the projector's and the rest of `visual` the tower's. Qwen3-VL's deepstack mergers go with the
tower, as LlamaFactory groups them (its vision_model_keys). The head (`lm_head`) trains with the
language model; a tied head is the embedding's parameter, which is the language model's.
"""
from __future__ import annotations

import torch.nn as nn

from ...errors import ArgumentError

KEYS = ("freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model")
TOWER, PROJECTOR, LANGUAGE = KEYS
# module name (its components, in order) -> the key whose part it holds; the longest match wins
PARTS = {("vision_tower",): TOWER, ("vision_model",): TOWER, ("visual",): TOWER,
         ("multi_modal_projector",): PROJECTOR, ("connector",): PROJECTOR, ("visual", "merger"): PROJECTOR,
         ("language_model",): LANGUAGE, ("text_model",): LANGUAGE, ("lm_head",): LANGUAGE}
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
    components = tuple(name.split("."))
    found, longest = None, 0
    for path, key in PARTS.items():
        n = len(path)
        if n > longest and any(components[i:i + n] == path for i in range(len(components) - n + 1)):
            found, longest = key, n
    return found


def names_of(key: str) -> list[str]:
    """The module names that make `key`'s part, as run.yaml's errors and docs give them."""
    return [".".join(path) for path, k in PARTS.items() if k == key]


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
                                f"{' or '.join(names_of(key))}; its top modules are {', '.join(_tops(params))}")
        if getattr(c, key):
            for n in found:
                params[n].requires_grad_(False)


def _tops(names) -> list[str]:
    """The modules under the model's wrappers (`model.`, PEFT's `base_model.model.`), for an error."""
    out = set()
    for n in names:
        parts = n.split(".")
        while len(parts) > 2 and parts[0] in ("base_model", "model"):
            parts = parts[1:]
        out.add(parts[0])
    return sorted(out)
