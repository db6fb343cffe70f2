"""A model that carries PEFT LoRA adapters, written as a user loads it: the adapter in PEFT's format
(adapter_config.json and adapter_model.safetensors, which `PeftModel.from_pretrained(base, folder)`
loads), or with merge the merged model (transformers' `from_pretrained` loads it). engine.save_pretrained
of a PEFT model and a LoRA run's export (train/methods/lora_export.py) both write through `save`;
a Trainer checkpoint's adapter (trainer_export.py) through `write_adapter`.

Both kinds are made from the engine's state, never from the module's own tensors: the adapters are
the fp32 masters, written in float32 as they trained; the merged model is a copy of the PEFT model
whose tensors are the host state's (the base's frozen weights, the adapters' masters), merged by
PEFT into new tensors, so neither the engine's state nor the user's module changes. The files are
written by PEFT and transformers into hf_save.py's export staging: a new folder appears whole, and in
a folder that exists only the export's own files are replaced (refused unless overwrite), nothing
else touched.
"""
from __future__ import annotations

import copy
import os
import shutil
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from ..errors import ArgumentError, MegacompileError
from . import durable, model_params, unbuilt
from .hf_save import (ADAPTER, COPIED, TOKENIZER_FILES, check_export_arguments, copy_source_files, finish_export,
                      shard_bytes, source_files, source_use_cache, write_export)
from .lora_adapter import peft_model

if TYPE_CHECKING:
    from ..state import TrainingState

# convert(adapters, config) -> (adapters, config fields to write in their place): a run's own
# adapter form turned into a plain LoRA on the base folder's weights (a PiSSA run's).
Convert = Callable[[dict, object], "tuple[dict, dict]"]


def carries_adapters(state: "TrainingState") -> bool:
    """Whether the engine's model is itself a PEFT model (engine.save_pretrained writes its adapter)."""
    found = peft_model(state.model)
    return found is not None and found[0] == ""


def save(state: "TrainingState", path: str, *, merge: bool, dtype: torch.dtype = torch.float32,
         overwrite: bool = False, max_shard_size: int | str = "5GB", tokenizer=None, source: str | None = None,
         prefix: str = "", convert: Convert | None = None) -> None:
    """The adapter (merge False; float32 whatever `dtype`) or the merged model in `dtype` into `path`.
    prefix: the PEFT model's name in the engine's model ("policy." in a post-training objective);
    tokenizer: written beside the export, else the tokenizer files of the folder the engine was
    loaded from are copied; source: the folder whose config.json says use_cache (the state's own by
    default); convert: see Convert (the merged model needs none: it is the state's own sum)."""
    check_export_arguments(dtype, overwrite)
    limit = shard_bytes(max_shard_size)
    peft = state.model.get_submodule(prefix.rstrip(".")) if prefix else state.model
    name = _adapter_name(peft)
    unbuilt.refuse_missing_weights(state)
    durable.prepare_parent(path, "model folder")        # refused before the weights are gathered
    model_params.synchronize(state)
    source = state.source_dir if source is None else source

    def write_adapter_export(folder: str) -> None:
        write_adapter(state, folder, prefix, convert)
        if tokenizer is not None:
            finish_export(folder, tokenizer)
        else:       # the base model's generation config is not the adapter's
            _finish(state, folder, TOKENIZER_FILES)

    def write_merged(folder: str) -> None:
        merged = merged_model(state, peft, prefix, name)
        merged.config.use_cache = source_use_cache(source)   # the engine turned the KV cache off for training only
        merged.to(dtype).save_pretrained(folder, max_shard_size=limit)
        if tokenizer is not None:
            finish_export(folder, tokenizer)
        else:
            _finish(state, folder, COPIED)
    # Either kind replaces a previous export of both kinds: an adapter left beside a merged model
    # (or a config beside an adapter) would make transformers load the folder as the other kind.
    write_export(os.fspath(path), set(COPIED) | {"config.json"} | set(ADAPTER), overwrite,
                 write_merged if merge else write_adapter_export)


def write_adapter(state: "TrainingState", folder: str, prefix: str | None = None,
                  convert: Convert | None = None) -> None:
    """The adapters' fp32 masters as PEFT writes an adapter: adapter_config.json and
    adapter_model.safetensors in `folder`. PEFT writes a README.md model card too: it is written
    aside and left out, so a README of the user's beside the export stays as it was."""
    if prefix is None:
        prefix = peft_model(state.model)[0]
    peft = state.model.get_submodule(prefix.rstrip(".")) if prefix else state.model
    config = peft.peft_config[_adapter_name(peft)]
    trainable = state.layout()[0]
    adapters = {key.removeprefix(prefix): t for key, t in unbuilt.state_tensors(state)
                if key in trainable and key.startswith(prefix)}
    fields = {}
    if convert is not None:
        adapters, fields = convert(adapters, config)
    before = {field: getattr(config, field) for field in fields}
    aside = os.path.join(folder, ".peft")
    try:
        for field, value in fields.items():
            setattr(config, field, value)
        peft.save_pretrained(aside, state_dict=adapters)
    finally:
        for field, value in before.items():
            setattr(config, field, value)
    for file in ADAPTER:
        os.replace(os.path.join(aside, file), os.path.join(folder, file))
    shutil.rmtree(aside)


def merged_model(state: "TrainingState", peft: nn.Module, prefix: str, name: str) -> nn.Module:
    """A copy of the PEFT model on the state's tensors, its adapters merged and unloaded: the base
    model with the trained weights. The copy shares the state's tensors (the module's own may be on
    meta, or stale); PEFT's safe_merge adds each adapter into a new tensor, not into them, and a
    parameter object of the copy is its own, so neither the state nor the user's module changes."""
    params = dict(peft.named_parameters(remove_duplicate=False))
    buffers = dict(peft.named_buffers(remove_duplicate=False))
    # deepcopy's memo maps each tensor to the one the copy holds: none of the weights is copied.
    memo: dict = {}
    for key, t in unbuilt.state_tensors(state):
        local = key.removeprefix(prefix) if key.startswith(prefix) else None
        if local in params:
            memo[id(params[local])] = nn.Parameter(t, requires_grad=False)   # tied names: one object
        elif local in buffers:
            memo[id(buffers[local])] = t
    for p in params.values():           # any the state lacks: the module's own, in a parameter of the copy's
        memo.setdefault(id(p), nn.Parameter(p.detach(), requires_grad=False))
    for b in buffers.values():
        memo.setdefault(id(b), b)
    shell = copy.deepcopy(peft, memo)
    return shell.merge_and_unload(safe_merge=True, adapter_names=[name])


def _adapter_name(peft: nn.Module) -> str:
    """The PEFT model's one LoRA adapter's name; another kind, or more than one, is refused."""
    configs = peft.peft_config
    kinds = {n: str(getattr(getattr(c, "peft_type", None), "value", getattr(c, "peft_type", None)))
             for n, c in configs.items()}
    if len(configs) != 1 or next(iter(kinds.values())) != "LORA":
        described = ", ".join(f"{n!r} ({k})" for n, k in kinds.items())
        raise MegacompileError(
            f"save_pretrained writes a PEFT model's one LoRA adapter (or, with merge_adapter=True, the model with "
            f"it merged); this model carries {described}: write it with engine.state_dict() and PEFT's own "
            "save_pretrained after engine.synchronize(), or keep one LoRA adapter (delete_adapter)")
    return next(iter(configs))


def _finish(state: "TrainingState", folder: str, names: tuple[str, ...]) -> None:
    """The tokenizer (and, for a model, generation) files of the folder the engine was loaded from
    copied beside an export PEFT or transformers wrote, and all of it synced."""
    copy_source_files(state, folder, source_files(state, names))
    for file in os.listdir(folder):
        durable.fsync_file(os.path.join(folder, file))
    durable.fsync_dir(folder)


def check_merge_adapter(merge_adapter, carries: bool) -> None:
    """merge_adapter is True or False, and True only for a PEFT model: on another it would say nothing."""
    if not isinstance(merge_adapter, bool):
        raise ArgumentError(f"merge_adapter is True (write the model with its LoRA adapter merged) or False "
                            f"(write the adapter in PEFT's format); got {merge_adapter!r}")
    if merge_adapter and not carries:
        raise ArgumentError("merge_adapter=True merges a PEFT model's LoRA adapter into its base, and this model "
                            "carries none (it is no PEFT model): call save_pretrained without it")
