"""The trained model of a post-training run as a Hugging Face model folder (trained_model.py
writes it where the run's model goes): a DPO, KTO or GRPO run's policy, a reward model as
transformers' one-label sequence classifier."""
from __future__ import annotations

import json
import os

import torch

from ..errors import ArgumentError


def export_policy(engine, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str) -> None:
    """The trained policy (the objective's `policy.` names without the prefix; transformers'
    from_pretrained loads it)."""
    engine.synchronize()
    policy = engine.model.policy
    weights = {k.removeprefix("policy."): t for k, t in engine.state_dict().items() if k.startswith("policy.")}
    with torch.device("meta"):
        shell = type(policy)(policy.config)
    _export(shell, weights, path, tokenizer, dtype, overwrite, source)


def export_reward_model(engine, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str) -> None:
    """The trained reward model (posttrain/reward.py: `model.` and `score.`, the names of
    transformers' *ForSequenceClassification), with the model's config given one label and the
    padding token it pools by; AutoModelForSequenceClassification.from_pretrained loads it."""
    from transformers import AutoModelForSequenceClassification
    engine.synchronize()
    config = engine.model.model.config.__class__.from_dict(engine.model.model.config.to_dict())
    config.num_labels = 1       # id2label and label2id follow
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.pad_token_id = pad
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(config)
    _export(shell, dict(engine.state_dict()), path, tokenizer, dtype, overwrite, source)


def _export(shell, weights: dict, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str) -> None:
    """`weights` loaded into `shell` (a model on meta) and written by transformers into
    io/hf_save.py's staging folder (a new folder appears whole; in one that exists only the
    export's own files are replaced, and only those of the run's own export)."""
    from ..io import durable
    from ..io.hf_save import COPIED, INDEX, SINGLE, refuse_replacing, write_files
    parent = durable.prepare_parent(path, "model folder")
    durable.clean_leftovers(parent)
    exists = os.path.isdir(path)
    if exists:
        durable.recover_files(path)
    replaced = refuse_replacing(path, set(COPIED) | {"config.json", SINGLE, INDEX}, overwrite)
    missing = [n for n, _ in shell.named_parameters() if n not in weights]
    if missing:
        raise ArgumentError(f"the trained model has no weights for {', '.join(missing[:4])}: cannot export it")
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
