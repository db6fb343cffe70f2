"""Where a run leaves its trained model, as TRL and LlamaFactory leave it in output_dir.

    export given          -> the export folder
    a Hugging Face model  -> the run folder (run_dir, which output_dir names)
    the bundled model     -> nowhere but the run's last checkpoint (it is no Hugging Face model)

The folder gets what transformers' `from_pretrained` loads: config.json, safetensors weights and
the tokenizer (for a vision-language model its processor); with `finetuning_type: lora` the
adapter in PEFT's format (`PeftModel.from_pretrained(base, folder)`), or with `merge_adapter` the
merged model. The writers are the export's own (engine.save_pretrained, lora_export, and
policy_export.py for a DPO or GRPO policy): in a folder that exists they write their own
files beside the others (the run folder's tokens/, plan/, log.csv, checkpoints/ stay as they
are), and a new run does not replace a model it did not write (refused before it trains).

The run's last printed line says where the model is (`last_line`).
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import ArgumentError
from ..io.hf_save import export_files
from . import methods
from .data import images, named_template
from .config import RunConfig


def folder(c: RunConfig, run_dir: str) -> str | None:
    """The folder the trained model goes to; None for the bundled model."""
    if c.export is not None:
        return c.export
    return None if c.bundled else run_dir


def holds_model(path: str) -> bool:
    return missing(path) is None


def missing(path: str) -> str | None:
    """What keeps the folder `path` from holding a whole export (a phrase after "its export"), or
    None: its config (config.json, or an adapter's adapter_config.json) and every safetensors file
    of its weights (each the index names), each file's header readable and its size that of the
    header and the tensors it lists. Cheap: no tensor is read."""
    from ..errors import WeightsFileError
    from ..io.hf_layout import INDEX, SINGLE
    from ..io.hf_save import ADAPTER
    if not export_files(path):
        return f"is not in {path}"
    config, weights = "config.json", [SINGLE]
    if os.path.isfile(os.path.join(path, INDEX)):
        try:
            with open(os.path.join(path, INDEX)) as f:
                weights = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"in {path} is not whole: its {INDEX} cannot be read ({e})"
    elif not os.path.isfile(os.path.join(path, SINGLE)) and os.path.isfile(os.path.join(path, ADAPTER[1])):
        config, weights = ADAPTER[0], [ADAPTER[1]]
    for name in (config, *weights):
        if not os.path.isfile(os.path.join(path, name)):
            return f"in {path} is not whole: {name} is missing"
    for name in weights:
        try:
            _check_whole(os.path.join(path, name))
        except WeightsFileError as e:
            return f"in {path} is not whole: {e}"
    return None


def _check_whole(file: str) -> None:
    """WeightsFileError unless the safetensors `file` ends where its last tensor does (its header
    read alone)."""
    from ..errors import WeightsFileError
    from ..io.header import read_header
    entries = read_header(file)     # raises for a header that cannot be read or a tensor past the end
    size = os.path.getsize(file)
    if not entries:
        raise WeightsFileError(f"{file} holds no tensor")
    end = max(e.end for e in entries.values())
    if size != end:
        raise WeightsFileError(f"{file} has {size} bytes, its header and tensors {end}")


def check_new_run(c: RunConfig, run_dir: str, resume_from: str | None) -> None:
    """Before training: a new run does not replace a model it did not write. A resumed run owns
    the model files of its folder (its first run found none there, or was refused here), and
    replaces them at its end; whatever else the folder holds is kept either way."""
    path = folder(c, run_dir)
    if path is None or resume_from is not None:
        return
    found = export_files(path)
    if not found:
        return
    listed = f"{', '.join(found[:6])}{', ...' if len(found) > 6 else ''}"
    if c.export is not None:
        raise ArgumentError(f"export {path} already holds a model export ({listed}), which this new run would "
                            "replace: give another export folder, or remove those files (a run resumed from its "
                            "checkpoints replaces its own export)")
    raise ArgumentError(f"run_dir {path} already holds a model ({listed}), which this new run would write its own "
                        "over at the end: give another run_dir (output_dir), or export: FOLDER, or remove those "
                        "files (a run resumed from its checkpoints replaces its own model)")


def write(c: RunConfig, engine, tokenizer, path: str, overwrite: bool, policy: bool = False) -> None:
    """The trained model into `path` by the export's writers; `policy`: the engine's model is a
    post-training objective, whose `policy` is the model trained. overwrite: the run's own model
    files are there (a resumed run)."""
    dtype = getattr(torch, c.export_dtype)
    if c.template is not None:      # written with the folder's own chat template, as LlamaFactory writes it
        tokenizer = named_template.exported(tokenizer, c.tokenizer or c.model)
    if c.stage == "rm":
        from .policy_export import export_reward_model
        export_reward_model(engine, path, tokenizer, dtype, overwrite=overwrite, source=c.model,
                            merge=not methods.adapters(c) or c.merge_adapter)
    elif methods.adapters(c):
        from .methods.lora_export import export
        export(engine, path, tokenizer, c.merge_adapter, dtype, overwrite=overwrite, source=c.model,
               prefix="policy." if policy else "", pissa=c.pissa)
    elif policy:
        from .policy_export import export_policy
        export_policy(engine, path, tokenizer, dtype, overwrite=overwrite, source=c.model)
    else:
        engine.save_pretrained(path, dtype=dtype, overwrite=overwrite)
        if (isinstance(tokenizer, images.Media) or c.chat_template is not None or c.template is not None
                or c.add_tokens or c.add_special_tokens     # the template, EOS or tokens trained with
                or not os.path.isfile(os.path.join(path, "tokenizer_config.json"))):
            tokenizer.save_pretrained(path)


def last_line(c: RunConfig, path: str | None, checkpoint: str | None) -> str:
    """The run's last line: where its trained model is and what loads it."""
    if path is None:
        return f"model: {checkpoint} (the bundled model is no Hugging Face model: its weights are in this checkpoint)"
    if methods.adapters(c) and not c.merge_adapter and c.stage == "rm":
        return (f"model: {path} (a LoRA reward model in PEFT's format, its adapters and head: PeftModel."
                f"from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, num_labels=1"
                f"{_pad_given(c, path)}), {path!r}))")
    if methods.adapters(c) and not c.merge_adapter:
        return f"model: {path} (a LoRA adapter in PEFT's format: PeftModel.from_pretrained(base, {path!r}))"
    if c.stage == "rm":
        return (f"model: {path} (a reward model, transformers' sequence classifier with one label: "
                f"AutoModelForSequenceClassification.from_pretrained({path!r}) loads it)")
    return f"model: {path} (a Hugging Face model folder: transformers' from_pretrained({path!r}) loads it)"


def _pad_given(c: RunConfig, path: str) -> str:
    """`, pad_token_id=N` where the base model's config has no padding token: transformers'
    classifier pools each row at its last token that is not padding, and without one it scores a
    batch of one row only. N is the token the run padded with (the tokenizer's, else its EOS)."""
    import json
    try:
        with open(os.path.join(c.model, "config.json")) as f:
            if json.load(f).get("pad_token_id") is not None:
                return ""
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return ""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return "" if pad is None else f", pad_token_id={pad}"
