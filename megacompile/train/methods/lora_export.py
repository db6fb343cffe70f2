"""The export of a LoRA run: the adapter in PEFT's format (adapter_config.json and
adapter_model.safetensors, which `PeftModel.from_pretrained(base, folder)` loads), or with
merge_adapter the merged model (transformers' `from_pretrained` loads it); the tokenizer beside
either. io/lora_save.py writes both, as it does for engine.save_pretrained of a PEFT model; what
is the run's own is its tokenizer, its source folder and a PiSSA run's adapter, converted here.
"""
from __future__ import annotations

import torch

from ...io import lora_save
from .pissa import Residual, converted


def export(engine, path: str, tokenizer, merge: bool, dtype: torch.dtype, overwrite: bool, source: str,
           prefix: str = "", pissa: Residual | None = None) -> None:
    """engine: the run's engine, its model the PEFT wrapper, or (prefix "policy.") a post-training
    objective whose `policy` is; source: the base model's folder. The adapter is written in float32,
    as it trained. pissa: a PiSSA run's Residual (methods/pissa.py): its adapter is written
    converted, a LoRA of twice the rank on the folder's own weights (its base in the host state is
    the residual, which a merge adds the adapters to)."""
    lora_save.save(engine.state, path, merge=merge, dtype=dtype, overwrite=overwrite, tokenizer=tokenizer,
                   source=source, prefix=prefix, convert=None if pissa is None else _as_lora(pissa))


def _as_lora(pissa: Residual):
    """io/lora_save.py's convert for a PiSSA run: the adapters as a plain LoRA of twice the rank."""
    def convert(adapters: dict, config) -> tuple[dict, dict]:
        from .lora import file_key
        adapters = converted(adapters, pissa, lambda n: file_key(n.split(".lora_")[0] + ".base_layer.weight"))
        # the same scaling; a plain LoRA now, loaded as any
        return adapters, {"r": 2 * config.r, "lora_alpha": 2 * config.lora_alpha, "init_lora_weights": True}
    return convert
