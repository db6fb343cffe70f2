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


def export_reward_model(engine, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str,
                        merge: bool = True) -> None:
    """The trained reward model (posttrain/reward.py: `model.` and `score.`, the names of
    transformers' *ForSequenceClassification), with the model's config given one label and the
    padding token it pools by; AutoModelForSequenceClassification.from_pretrained loads it. A LoRA
    run's (its adapters' settings on the model, stages/rm.py) has its adapters merged into the
    decoder, or without `merge` is written as PEFT's sequence-classification adapter: the adapters
    and the head (modules_to_save), which PeftModel.from_pretrained loads over the base model's
    AutoModelForSequenceClassification."""
    from transformers import AutoModelForSequenceClassification

    from .methods import merged, scaling, transposed
    engine.synchronize()
    weights = dict(engine.state_dict())
    adapters = getattr(engine.model, "adapters", None)
    if adapters is not None and not merge:
        return _reward_adapter(weights, adapters, path, tokenizer, overwrite, source)
    if adapters is not None:
        weights = merged(weights, scaling(adapters), transposed(engine.model))
    config = engine.model.model.config.__class__.from_dict(engine.model.model.config.to_dict())
    config.num_labels = 1       # id2label and label2id follow
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config.pad_token_id = pad
    config.get_text_config().pad_token_id = pad     # where a vision-language model's classifier reads it
    with torch.device("meta"):
        shell = AutoModelForSequenceClassification.from_config(config)
    _export(shell, weights, path, tokenizer, dtype, overwrite, source)


def _reward_adapter(weights: dict, adapters, path: str, tokenizer, overwrite: bool, source: str) -> None:
    """The adapters and the head in float32, as they trained, under PEFT's names for a
    sequence classifier (`base_model.model.` ahead, no adapter name), and its adapter_config.json."""
    import copy

    from safetensors.torch import save_file

    from ..io.hf_save import ADAPTER, COPIED, finish_export, write_export
    tensors = {"base_model.model." + k.replace(".default.", "."): t.float().contiguous() for k, t in weights.items()
               if ".lora_A." in k or ".lora_B." in k or k.startswith("score.")}
    config = copy.deepcopy(adapters)
    config.task_type, config.modules_to_save, config.inference_mode = "SEQ_CLS", ["classifier", "score"], True
    config.base_model_name_or_path = os.path.abspath(source)

    def write(folder: str) -> None:
        config.save_pretrained(folder)
        save_file(tensors, os.path.join(folder, ADAPTER[1]), metadata={"format": "pt"})
        finish_export(folder, tokenizer)
    write_export(path, set(COPIED) | {"config.json"} | set(ADAPTER), overwrite, write)


def _export(shell, weights: dict, path: str, tokenizer, dtype: torch.dtype, overwrite: bool, source: str) -> None:
    """`weights` loaded into `shell` (a model on meta) and written by transformers into
    io/hf_save.py's staging folder (a new folder appears whole; in one that exists only the
    export's own files are replaced, and only those of the run's own export)."""
    from ..io.hf_save import COPIED, INDEX, SINGLE, finish_export, write_export
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
        finish_export(folder, tokenizer)
    write_export(path, set(COPIED) | {"config.json", SINGLE, INDEX}, overwrite, write)
