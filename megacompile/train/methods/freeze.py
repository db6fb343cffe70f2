"""finetuning_type: freeze: the last (or first) N decoder blocks trained, some of their modules,
and modules outside them (LlamaFactory's freeze_* keys); the rest frozen.

The parameters trained are the ones LlamaFactory's _setup_freeze_tuning (model/adapter.py) trains,
by its own rule: a pattern `.{i}.{module}` for each trained block index i and each name of
freeze_trainable_modules (`.{i}.` for `all`), plus each name of freeze_extra_modules, and a
parameter trains when its name CONTAINS one of them (a substring, not whole name parts): `norm`
trains the final `model.norm` and every block's `input_layernorm`, `post_attention_layernorm`,
`q_norm`, `k_norm`, the frozen blocks' too; `.2.` matches expert 2 of every block of a
mixture-of-experts model. The names are checked as LlamaFactory checks them: a module name must
be one of the blocks' own modules (the name after `.0.` in a parameter's name), an extra one of the
modules outside any numbered list (a parameter's module's last name). What each name trains beyond
its own module is said in a note (`notes`), not left to be found.

Beyond LlamaFactory, a name with a dot names a module's path, which LlamaFactory would refuse:
`mlp.down_proj` in freeze_trainable_modules, `model.norm` in freeze_extra_modules (the final norm
alone); each matches as a substring too. freeze_trainable_layers beyond the model's block count is
refused (LlamaFactory trains every block).

On a vision-language model the tower and the projector stay frozen unless freeze_vision_tower /
freeze_multi_modal_projector is false, as LlamaFactory's defaults (true) keep them under freeze;
freeze_multi_modal_projector: false trains the projector whole, as LlamaFactory adds its names to
the patterns; freeze_language_model: true freezes the language model and its head.
"""
from __future__ import annotations

import re

import torch.nn as nn

from ...errors import ArgumentError
from .names import ALL
from .vision_freeze import LANGUAGE, PROJECTOR, TOWER, is_vision_language, part_of

NUMBERED = re.compile(r"\.\d+\.")
SHOWN = 4          # parameter names a note shows


def blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the ModuleList of config.num_hidden_layers modules (else the longest)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    wanted = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    fitting = [x for x in lists if len(x[1]) == wanted] or lists
    if not fitting:
        raise ArgumentError(f"{type(model).__name__} has no list of decoder blocks (an nn.ModuleList): "
                            "finetuning_type lora with lora_target all, and freeze, need one")
    return max(fitting, key=lambda x: len(x[1]))


def layer_count(model: nn.Module) -> int:
    """The decoder block count as LlamaFactory reads it (the text config's num_hidden_layers,
    num_layers or n_layer); a model whose config has none (the bundled one) counts its blocks."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    found = (getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
             or getattr(config, "n_layer", None))
    return found if isinstance(found, int) and found > 0 else len(blocks(model)[1])


def their_module_names(names) -> tuple[set[str], set[str]]:
    """LlamaFactory's two name sets: the blocks' modules (what follows the last `.0.`, else `.1.`,
    in a parameter's name, up to the next dot) and the modules outside any numbered list (the
    module's last name of each parameter whose name has no `.N.`)."""
    hidden, outside = set(), set()
    for name in names:
        if ".0." in name:
            hidden.add(name.split(".0.")[-1].split(".")[0])
        elif ".1." in name:
            hidden.add(name.split(".1.")[-1].split(".")[0])
        if NUMBERED.search(name) is None and "." in name:
            outside.add(name.split(".")[-2])
    return hidden, outside


def select(model: nn.Module, layers: int, modules: list[str] | str, extra: list[str], tower: bool | None = None,
           projector: bool | None = None, language: bool | None = None) -> tuple[set[str], list[str]]:
    """The names of the parameters LlamaFactory's freeze tuning trains on `model`, and the notes
    that say what its substring matching trains beyond the modules named (module docstring).
    tower, projector, language: the run's freeze_vision_tower, freeze_multi_modal_projector,
    freeze_language_model (None: unset)."""
    names = [n for n, _ in model.named_parameters()]
    count = layer_count(model)
    if abs(layers) > count:
        raise ArgumentError(f"freeze_trainable_layers {layers}: {type(model).__name__} has {count} decoder "
                            f"blocks; give 1..{count} (the last N) or -{count}..-1 (the first N)")
    chosen = range(count - layers, count) if layers > 0 else range(-layers)
    hidden, outside = their_module_names(names)
    notes = []

    wanted = [ALL] if modules == ALL else modules
    absent = [m for m in wanted if m != ALL and m not in hidden
              and not ("." in m and any(re.search(rf"\.\d+\.{re.escape(m)}\.", n) for n in names))]
    if absent:
        raise ArgumentError(f"freeze_trainable_modules: {', '.join(absent)} names no parameter of the decoder blocks; "
                            f"their modules are {', '.join(sorted(hidden))} (or all; a path under one, such as "
                            "mlp.down_proj, names part of it)")
    absent = [m for m in extra if m not in outside
              and not ("." in m and any(f".{n}".startswith(f".{m}.") or f".{m}." in f".{n}" for n in names))]
    if absent:
        raise ArgumentError(f"freeze_extra_modules: {', '.join(absent)} names no parameter of {type(model).__name__} "
                            f"outside its decoder blocks; modules outside the blocks are {', '.join(sorted(outside))}"
                            " (a path such as model.norm names one alone)")
    for m in (m for m in wanted if m not in hidden and m != ALL):
        notes.append(f"freeze_trainable_modules {m}: a path under a block's module, which LlamaFactory refuses (it "
                     f"takes the blocks' own modules: {', '.join(sorted(hidden))}); the parameters whose names "
                     f"contain .N.{m} of a trained block N train")
    for m in (m for m in extra if m not in outside):
        notes.append(f"freeze_extra_modules {m}: a module's path, which LlamaFactory refuses (it takes a module's "
                     f"last name: {', '.join(sorted(outside))}); the parameters whose names contain {m} train")

    block_patterns = [f".{i}.{'' if m == ALL else m}" for m in wanted for i in chosen]
    vision = is_vision_language(model)
    frozen_parts = {TOWER} if tower is not False else set()
    frozen_parts |= {PROJECTOR} if projector is not False else set()
    frozen_parts |= {LANGUAGE} if language else set()

    def forbidden(name: str) -> bool:
        return vision and part_of(name) in frozen_parts

    def matched(name: str) -> bool:
        return any(p in name for p in block_patterns) or any(m in name for m in extra)
    trained = {n for n in names if (matched(n) or (vision and projector is False and part_of(n) == PROJECTOR))
               and not forbidden(n)}

    # What the substring rule trains beyond the modules named, said: the blocks' patterns outside
    # the chosen blocks' own modules, each extra name beyond its own module's parameters.
    prefixes = [p for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == count
                and NUMBERED.search(f".{p}.") is None and part_of(p) not in (TOWER, PROJECTOR)]
    own = [f"{p}.{i}.{'' if m == ALL else m + '.'}" for p in prefixes for m in wanted for i in chosen]
    beyond = sorted(n for n in trained if any(b in n for b in block_patterns) and not any(n.startswith(o) for o in own)
                    and not any(m in n for m in extra))
    if beyond:
        notes.append(f"freeze_trainable_layers {layers}: LlamaFactory's patterns "
                     f"{', '.join(dict.fromkeys(block_patterns))} match any numbered module, so {len(beyond)} "
                     f"parameter{'s' if len(beyond) > 1 else ''} outside the chosen blocks' modules train too: "
                     f"{_shown(beyond)}")
    for m in extra:
        alone = (lambda n, m=m: f".{n}".startswith(f".{m}.") or f".{m}." in f".{n}")
        more = sorted(n for n in trained if m in n and not alone(n) and not any(b in n for b in block_patterns))
        if more:
            path = _path_of(names, m)
            notes.append(f"freeze_extra_modules {m}: as in LlamaFactory, every parameter whose name contains it "
                         f"trains, {len(more)} besides {m}'s own: {_shown(more)}"
                         + (f"; a path ({path}) names one module alone" if "." in path else ""))
    if vision and (tower is None or projector is None) and any(matched(n) and forbidden(n) for n in names):
        notes.append("the vision tower and the projector stay frozen under finetuning_type freeze, as LlamaFactory's "
                     "defaults (freeze_vision_tower, freeze_multi_modal_projector: true) keep them; set them false to "
                     "train what the freeze_* names match there")
    return trained, [f"finetuning_type freeze: {n}" for n in notes]


def freeze(model: nn.Module, layers: int, modules: list[str] | str, extra: list[str], tower: bool | None = None,
           projector: bool | None = None, language: bool | None = None) -> list[str]:
    """Set requires_grad as LlamaFactory's freeze tuning would (select); returns select's notes."""
    trained, notes = select(model, layers, modules, extra, tower, projector, language)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)
    return notes


def _shown(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (f", ... ({len(names) - SHOWN} more)" if len(names) > SHOWN else "")


def _path_of(names: list[str], module: str) -> str:
    """The path of `module` outside the numbered lists (model.norm for norm), for a note."""
    for n in names:
        if NUMBERED.search(n) is None and n.split(".")[-2:-1] == [module]:
            return n.rsplit(".", 1)[0]
    return module
