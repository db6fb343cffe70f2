"""The export of a LoRA run: the adapter in PEFT's format (adapter_config.json and
adapter_model.safetensors, which `PeftModel.from_pretrained(base, folder)` loads), or with
merge_adapter the merged model (transformers' `from_pretrained` loads it); the tokenizer beside
either.

The trained adapters come from the engine's fp32 masters (engine.synchronize writes them into
the module). The files are written by PEFT and transformers into the staging folder of
io/hf_save.py's export writer: a new folder appears whole, and in a folder that exists only the
export's own files are replaced (refused unless it is the run's own export), nothing else touched.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.nn as nn

from ...io import unbuilt
from ...io.hf_save import ADAPTER, COPIED, finish_export, write_export
from .pissa import converted


def export(engine, path: str, tokenizer, merge: bool, dtype: torch.dtype, overwrite: bool, source: str,
           prefix: str = "", pissa=None) -> None:
    """engine: the run's engine, its model the PEFT wrapper, or (prefix "policy.") a post-training
    objective whose `policy` is; source: the base model's folder. With merge, the module is merged in
    place (the export is the run's last use of it); the adapter is written in float32, as it trained.
    pissa: a PiSSA run's Residual (methods/pissa.py): its adapter is written converted, a LoRA of
    twice the rank on the folder's own weights (its base in the host state is the residual, which
    a merge adds the adapters to)."""
    engine.synchronize()
    model = engine.model.get_submodule(prefix.rstrip(".")) if prefix else engine.model

    def write_adapter(folder: str) -> None:
        # PEFT writes a README.md model card too: it is written aside and left out, so a README
        # of the user's beside the export stays as it was.
        aside = os.path.join(folder, ".peft")
        # The adapters only: the module's base is on meta (its values are the engine's).
        adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        config = model.peft_config["default"]
        before = config.r, config.lora_alpha, config.init_lora_weights
        if pissa is not None:
            from .lora import file_key
            adapters = converted(adapters, pissa, lambda n: file_key(n.split(".lora_")[0] + ".base_layer.weight"))
            config.r, config.lora_alpha = 2 * config.r, 2 * config.lora_alpha      # the same scaling
            config.init_lora_weights = True     # a plain LoRA now, loaded as any
        try:
            model.save_pretrained(aside, state_dict=adapters)
        finally:
            config.r, config.lora_alpha, config.init_lora_weights = before
        for name in ADAPTER:
            os.replace(os.path.join(aside, name), os.path.join(folder, name))
        shutil.rmtree(aside)
        finish_export(folder, tokenizer)

    def write_merged(folder: str) -> None:
        # The base lives in the engine's host state (the module's is on meta): the module takes
        # views of it, and safe_merge adds each adapter into a new tensor, not into them.
        for key, t in unbuilt.state_tensors(engine.state):
            if not key.startswith(prefix):
                continue
            owner, _, leaf = key.removeprefix(prefix).rpartition(".")
            module = model.get_submodule(owner)
            if leaf in module._parameters and module._parameters[leaf].is_meta:
                module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        merged = model.merge_and_unload(safe_merge=True)
        with open(os.path.join(source, "config.json")) as f:     # the run turned the KV cache off for training only
            merged.config.use_cache = json.load(f).get("use_cache", True)
        merged.to(dtype).save_pretrained(folder)
        finish_export(folder, tokenizer)
    # Either kind replaces a previous export of both kinds: an adapter left beside a merged model
    # (or a config beside an adapter) would make transformers load the folder as the other kind.
    write_export(path, set(COPIED) | {"config.json"} | set(ADAPTER), overwrite, write_merged if merge else write_adapter)
