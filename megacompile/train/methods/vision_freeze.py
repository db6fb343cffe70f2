"""Which parts of a vision-language model train: LlamaFactory's `freeze_vision_tower`,
`freeze_multi_modal_projector` and `freeze_language_model`.

A key set to true freezes its part after finetuning_type chose what trains (full: everything,
freeze: some decoder blocks); unset or false leaves that choice alone. Unlike LlamaFactory, whose
defaults freeze the tower and the projector, an unset key freezes nothing: a run without them
trains what it trained before (set `freeze_vision_tower: true` and `freeze_multi_modal_projector:
true` for LlamaFactory's defaults). Under finetuning_type lora every base weight is frozen and the
keys say which parts' Linear modules take adapters, as LlamaFactory's LoRA chooses them (`adapted`):
the language model's unless freeze_language_model is true; the tower's where freeze_vision_tower is
false (`lora_target: all` then adds the tower's Linear names, LlamaFactory's
find_all_linear_modules); the projector's where freeze_multi_modal_projector is false and
lora_target names them (`all` leaves the projector out, as LlamaFactory's does).

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
LLAMAFACTORY_DEFAULTS = {TOWER: True, PROJECTOR: True, LANGUAGE: False}
# module name (its components, in order) -> the key whose part it holds; the longest match wins
PARTS = {("vision_tower",): TOWER, ("vision_model",): TOWER, ("visual",): TOWER,
         ("multi_modal_projector",): PROJECTOR, ("connector",): PROJECTOR, ("visual", "merger"): PROJECTOR,
         ("language_model",): LANGUAGE, ("text_model",): LANGUAGE, ("lm_head",): LANGUAGE}
# The parts whose Linear modules take LoRA adapters when no key says otherwise.
LANGUAGE_ONLY = frozenset({LANGUAGE})
# each part in words, as LoRA's errors name them
WORDS = {TOWER: "the vision tower", PROJECTOR: "the projector", LANGUAGE: "the language model"}


def check(c, adapters: bool) -> None:
    """The keys' values on the RunConfig `c`: unset (None), true or false; `adapters`: the run trains
    LoRA adapters (methods.adapters)."""
    for key in KEYS:
        value = getattr(c, key)
        if value is not None and not isinstance(value, bool):
            raise ArgumentError(f"{key} must be true or false (a vision-language model's part frozen or not); got "
                                f"{value!r}")
    if adapters and not adapted(c):
        raise ArgumentError("freeze_language_model: true under finetuning_type lora leaves no part to put adapters "
                            "on: set freeze_vision_tower: false too (adapters on the vision tower's Linear modules, "
                            "as LlamaFactory puts them), or leave freeze_language_model out")


def adapted(c) -> frozenset[str]:
    """The parts whose Linear modules take adapters under finetuning_type lora, as LlamaFactory's
    LoRA leaves out the frozen ones (its get_forbidden_modules): the language model unless
    freeze_language_model is true, the tower and the projector where their keys are false (unset,
    they stay frozen without adapters, LlamaFactory's defaults)."""
    parts = {LANGUAGE} if c.freeze_language_model is not True else set()
    parts |= {k for k in (TOWER, PROJECTOR) if getattr(c, k) is False}
    return frozenset(parts)


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


def adapted_names(model: nn.Module, names: list[str], parts: frozenset[str]) -> list[str]:
    """The full names of the modules of `parts` whose last name is one of `names` (LoRA's targets on
    a vision-language model: the tower has q_proj and the like too)."""
    return [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in names and part_of(n) in parts]


def tower_linear_names(model: nn.Module) -> list[str]:
    """The last names of the vision tower's nn.Linear modules (the projector's left out)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and part_of(n) == TOWER})


def apply(c, model: nn.Module) -> None:
    """Freeze the parts whose key is true (in place); on a model without a vision tower, refuse
    any key given away from LlamaFactory's default (which its dumps write, and which asks for
    nothing of a text model)."""
    set_keys = [k for k in KEYS if getattr(c, k) is not None]
    if not is_vision_language(model):
        set_keys = [k for k in set_keys if getattr(c, k) != LLAMAFACTORY_DEFAULTS[k]]
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
