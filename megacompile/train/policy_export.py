"""The trained policy of a DPO or GRPO run as a Hugging Face model folder (trained_model.py writes
it where the run's model goes)."""
from __future__ import annotations

import json
import os

import torch

from ..errors import ArgumentError


def export_policy(engine, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str) -> None:
    """The trained policy as a Hugging Face model folder (the objective's `policy.` names without the
    prefix; transformers' from_pretrained loads it): its fp32 masters loaded into the policy module,
    written by transformers into io/hf_save.py's staging folder (a new folder appears whole; in one
    that exists only the export's own files are replaced, and only those of the run's own export)."""
    from ..io import durable
    from ..io.hf_save import COPIED, INDEX, SINGLE, refuse_replacing, write_files
    parent = durable.prepare_parent(path, "model folder")
    durable.clean_leftovers(parent)
    exists = os.path.isdir(path)
    if exists:
        durable.recover_files(path)
    replaced = refuse_replacing(path, set(COPIED) | {"config.json", SINGLE, INDEX}, overwrite)
    engine.synchronize()
    policy = engine.model.policy
    weights = {k.removeprefix("policy."): t for k, t in engine.state_dict().items() if k.startswith("policy.")}
    with torch.device("meta"):
        shell = type(policy)(policy.config)
    missing = [n for n, _ in shell.named_parameters() if n not in weights]
    if missing:
        raise ArgumentError(f"the trained policy has no weights for {', '.join(missing[:4])}: cannot export it")
    shell.load_state_dict(weights, strict=False, assign=True)
    shell.tie_weights()
    config = os.path.join(source, "config.json") if os.path.isdir(source) else source
    with open(config) as f:     # the run turned the KV cache off for training only
        shell.config.use_cache = json.load(f).get("use_cache", True)

    def write(folder: str) -> None:
        shell.to(dtype).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        for name in os.listdir(folder):
            durable.fsync_file(os.path.join(folder, name))
        durable.fsync_dir(folder)
    write_files(path, parent, exists, write, replaced)
