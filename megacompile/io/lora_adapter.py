"""A LoRA adapter PEFT saved (adapter_config.json, adapter_model.safetensors) read into an engine
whose model carries the same adapters: a LoRA run's Trainer checkpoint (trainer_checkpoint.py).

PEFT writes each adapter tensor without its adapter's name (`...q_proj.lora_A.weight` for the
module's `...q_proj.lora_A.default.weight`; a DoRA magnitude as `...q_proj.lora_magnitude_vector`; a
module trained whole, modules_to_save, under its own name: `lm_head.weight`) and under the PEFT
model's own prefix, which a wrapper around it (a post-training objective's `policy.`) lengthens: a
file key names the trainable parameter whose name, so written (saved_as), ends with it, and each
must name exactly one. The adapter's
config must be the model's (rank, alpha, target modules): moments of rank 16 would not fit rank 8,
and another alpha would scale the same weights otherwise; a difference is refused by name.

The base weights are not in the folder: they are the engine's already (in its host state), or wait
in its pending load, which the adapter then joins rather than replaces.
"""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch.nn as nn

from ..errors import WeightsFileError
from .header import read_header
from .source import MASTER, WEIGHT, Item, PendingLoad

if TYPE_CHECKING:
    from ..state.training import TrainingState

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def holds_adapter(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in (CONFIG, WEIGHTS))


def items(state: "TrainingState", path: str) -> list[Item]:
    """The adapter's tensors as loads of the engine's trainable parameters, every one of them checked."""
    return _items(state.model, state.layout()[0], path)


def check(model: nn.Module, path: str) -> None:
    """What load() refuses, refused against a model before any engine exists (on meta will do)."""
    _items(model, {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}, path)


def _items(model: nn.Module, trainable: dict[str, tuple], path: str) -> list[Item]:
    check_config(model, path)
    found = peft_model(model)
    adapter = next(iter(found[1].peft_config)) if found is not None else "default"
    plain = {saved_as(name, adapter): name for name in trainable}
    file = os.path.join(path, WEIGHTS)
    out, problems = [], []
    for key, entry in read_header(file).items():
        names = [name for p, name in plain.items() if p == key or p.endswith("." + key)]
        if len(names) != 1:
            problems.append(f"{key} names {'no' if not names else len(names)} trainable parameters of this model")
        elif tuple(entry.shape) != trainable[names[0]]:
            problems.append(f"{key} has shape {tuple(entry.shape)}, {names[0]} has {trainable[names[0]]}")
        else:
            out.append(Item(file, key, WEIGHT, names[0]))
    missing = sorted(set(trainable) - {it.name for it in out})
    problems += [f"it holds nothing for {name}" for name in missing[:3]]
    if problems:
        raise WeightsFileError(f"cannot take in the LoRA adapter in {path}: {'; '.join(problems[:4])}; nothing was "
                               "loaded")
    return out


def saved_as(name: str, adapter: str = "default") -> str:
    """A trainable parameter's name as PEFT's adapter file has it: without its adapter's name
    (`lora_A.default.weight` as `lora_A.weight`, an Embedding's `lora_embedding_A.default` as
    `lora_embedding_A`), a DoRA magnitude without `.weight` too, and a
    module trained whole (modules_to_save: `lm_head.modules_to_save.default.weight`) under the
    wrapped module's own name (`lm_head.weight`)."""
    name = name.replace(f".modules_to_save.{adapter}.", ".")
    name = name.replace(f".lora_magnitude_vector.{adapter}.weight", ".lora_magnitude_vector")
    # An Embedding's adapters are parameters of its own, named by the adapter alone (lora_embedding_A.default).
    return name.replace(f".{adapter}.", ".").removesuffix(f".{adapter}")


def load(state: "TrainingState", path: str) -> None:
    """The adapter's weights into the engine's adapters (their masters and compute copies); the AdamW
    state is untouched (a new run's: none yet)."""
    load = PendingLoad(items(state, path), own_buffers=True, describe=f"the LoRA adapter in {path}")
    state.weights_arrive(beside_the_base(state, load))


def beside_the_base(state: "TrainingState", load: PendingLoad) -> PendingLoad:
    """The adapter's load, with the base weights where they wait (module_params: the module's own)."""
    if state.host is not None:
        return load          # the base is in the host state: only the adapters and moments are written
    adapters = {it.name for it in load.items if it.table in (WEIGHT, MASTER)}
    pending = state.pending_load
    if isinstance(pending, PendingLoad):
        return replace(load, items=[it for it in pending.items if it.name not in adapters] + load.items,
                       own_params=tuple(n for n in pending.own_params if n not in adapters),
                       own_buffers=pending.own_buffers or load.own_buffers)
    if pending is not None:
        raise WeightsFileError("load_state_dict has loaded part of the weights, which a LoRA adapter's Trainer "
                               "checkpoint cannot be taken in beside: load them whole first, or take the "
                               "checkpoint in after the first step")
    return replace(load, own_params=tuple(n for n, p in state.model.named_parameters()
                                          if not p.is_meta and n not in adapters))


def check_config(model, path: str) -> None:
    """The adapter's config is the model's adapters': refused by name otherwise."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsFileError(f"cannot read {os.path.join(path, CONFIG)}: {e}") from e
    ours = peft_config(model)
    if ours is None:
        raise WeightsFileError(
            f"{path} holds a LoRA adapter (rank {saved.get('r')}, alpha {saved.get('lora_alpha')}, on "
            f"{_targets(saved.get('target_modules'))}) and this model has none: give it the same adapters "
            "(run.yaml finetuning_type: lora with that lora_rank, lora_alpha and lora_target); nothing was loaded")
    differences = []
    # (key, run.yaml's, whether absent means off)
    for key, run_key, flag in (("r", "lora_rank", False), ("lora_alpha", "lora_alpha", False),
                               ("use_dora", "use_dora", True), ("use_rslora", "use_rslora", True)):
        theirs, mine = saved.get(key, False if flag else None), getattr(ours, key, None)
        if theirs != mine and not (flag and not theirs and not mine):
            differences.append(f"{key} {theirs!r} (this model {mine!r}" + (f"; run.yaml {run_key}" if run_key else "")
                               + ")")
    if _targets(saved.get("target_modules")) != _targets(ours.target_modules):
        differences.append(f"target_modules {_targets(saved.get('target_modules'))} (this model "
                           f"{_targets(ours.target_modules)}; run.yaml lora_target)")
    saved_weights, our_weights = (_targets(c.get("target_parameters") if isinstance(c, dict)
                                           else getattr(c, "target_parameters", None)) for c in (saved, ours))
    if saved_weights != our_weights:      # a mixture-of-experts' fused expert weights
        differences.append(f"target_parameters {saved_weights} (this model {our_weights}; run.yaml lora_target)")
    if differences:
        raise WeightsFileError(f"the LoRA adapter in {path} is not this model's: {'; '.join(differences)}; nothing "
                               "was loaded")


def peft_config(model):
    """The model's LoRA config (PEFT's, of its first adapter), or None where it carries no adapters."""
    found = peft_model(model)
    return None if found is None else next(iter(found[1].peft_config.values()))


def peft_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(its name's prefix in `model`, the PEFT model): the module carrying the adapters' configs (the
    model itself, or a post-training objective's `policy`); None where there is none."""
    for name, module in model.named_modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and configs:
            return (f"{name}." if name else ""), module
    return None


def _targets(value) -> str:
    """target_modules as one comparable text: a list's or set's sorted names, a pattern as it is
    (none, or an empty list, as None)."""
    if not value:
        return "None"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(sorted(value))
    return str(value)
