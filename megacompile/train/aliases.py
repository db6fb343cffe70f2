"""run.yaml keys under the names LlamaFactory and transformers' TrainingArguments (and so TRL's
SFTConfig) give them, read as megacompile's own keys (config.py).

    ALIASES   alias -> (own key, conversion of the value)
    IGNORED   keys that do nothing in a single-process run, accepted and named in a note
    REFUSED   keys whose only values megacompile cannot honour

Both spellings of one setting with different values are refused, naming both; the same value
twice is fine. The command line's `key=value` overrides go through the same table: an override
replaces the file's value whichever spelling either used (`own_key`).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

from ..errors import ArgumentError
from . import intervals
from .data.named_template import NAMES as LAYOUTS
from . import their_llamafactory, trainer_args
from .their_keys import NOT_TAKEN, ONLY_WITH, ZERO_IS_OFF, off, stage_note

_DROP = object()       # an alias value that sets nothing (HF's max_steps: -1, "use the epochs")


def _same(value: Any) -> Any:
    return value


def _set(value: Any) -> Any:
    """transformers' null default (run_name: None, what a TrainingArguments dump writes) sets nothing."""
    return _DROP if value is None else value


def _max_steps(value: Any) -> Any:
    return _DROP if isinstance(value, int) and not isinstance(value, bool) and value <= 0 else value


def _resume(value: Any) -> Any:
    if value is True:
        return "auto"
    return None if value is False else value


def _thinking(value: Any) -> Any:
    """LlamaFactory's enable_thinking: the chat template's own switch (Qwen3's, and others')."""
    if not isinstance(value, bool):
        raise ArgumentError(f"enable_thinking must be true or false; got {value!r}")
    return {"enable_thinking": value}


def _preserve(value: Any) -> Any:
    """LlamaFactory's preserve_thinking: true keeps the earlier answers' thoughts under mask_history
    (its reasoning layouts drop them, named_template.py); false, its default, sets nothing."""
    if not isinstance(value, bool):
        raise ArgumentError(f"preserve_thinking must be true or false; got {value!r}")
    return {"preserve_thinking": True} if value else _DROP


def _dft(value: Any) -> Any:
    """LlamaFactory's use_dft_loss: true is TRL's loss_type dft; false (its default) sets nothing."""
    if not isinstance(value, bool):
        raise ArgumentError(f"use_dft_loss must be true or false; got {value!r}")
    return "dft" if value else _DROP


def _eaft(value: Any) -> Any:
    """LlamaFactory's use_eaft_loss: true is loss_type eaft; false (its default) sets nothing."""
    if not isinstance(value, bool):
        raise ArgumentError(f"use_eaft_loss must be true or false; got {value!r}")
    return "eaft" if value else _DROP


def _bf16(value: Any) -> Any:
    if not isinstance(value, bool):
        raise ArgumentError(f"bf16 must be true or false; got {value!r}")
    return "bfloat16" if value else "float32"


def _fp16(value: Any) -> Any:
    if value is True:
        raise ArgumentError("fp16: true is refused: megacompile computes in float32 or bfloat16 (bf16: true, or "
                            "compute_dtype: bfloat16) and keeps FP32 masters; float16 would need loss scaling it "
                            "does not do")
    if value is not False and value is not None:
        raise ArgumentError(f"fp16 must be true or false; got {value!r}")
    return _DROP


def _total_limit(value: Any) -> Any:
    """transformers removes no checkpoint when save_total_limit is 0 or below (or null)."""
    return None if isinstance(value, int) and not isinstance(value, bool) and value <= 0 else value


def _val_size(value: Any) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 1:
        raise ArgumentError(f"val_size {value!r} is a count of examples; megacompile holds out a fraction "
                            "(val_size: 0.05, or eval_fraction); give a number below 1")
    return value


def _do_train(value: Any) -> None:
    if value is not True:
        raise ArgumentError(f"do_train {value!r}: megacompile train always trains; leave do_train out or "
                            "give true (a dump of transformers' TrainingArguments writes false, its default, "
                            "which its Trainer does not read)")


def _sampling(value: Any) -> Any:
    """transformers' train_sampling_strategy (KTOConfig's default: sequential, its KL rows paired in
    the files' order): sequential is disable_shuffling; random, TrainingArguments' default, sets nothing."""
    if value == "sequential":
        return True
    if value in ("random", None):
        return _DROP
    raise ArgumentError(f"train_sampling_strategy {value!r} is not supported: rows are shuffled by seed (random) "
                        "or taken in the files' order (sequential, disable_shuffling: true), not grouped by length")


def _strategy(key: str, own: str | None) -> Callable[[Any], Any]:
    """HF's *_strategy: `steps`; for eval and saves also `epoch` (at each epoch's end) and `no`
    (YAML reads a bare `no`, in a file or in a key=value override, as false)."""
    def convert(value: Any) -> Any:
        if value is False:
            value = "no"
        if value == "steps" or (value in ("no", "epoch") and own is not None):
            return value
        if own is None:
            raise ArgumentError(f"{key} {value!r}: log.csv has a row for every optimizer step; give {key}: steps, "
                                "with logging_steps for the progress line")
        raise ArgumentError(f"{key} {value!r}: megacompile {'evaluates' if own == 'eval_every' else 'saves'} every "
                            f"{key.replace('_strategy', '_steps').replace('evaluation', 'eval')} steps or at each "
                            f"epoch's end; give {key}: steps, epoch or no")
    return convert


# alias -> (own key, conversion). Several aliases of one key (cutoff_len, max_length,
# max_seq_length -> seq) are spellings of it like any other.
ALIASES: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "learning_rate": ("lr", _same),
    "per_device_train_batch_size": ("batch", _same),
    "per_device_eval_batch_size": ("eval_batch", _same),
    "early_stopping_steps": ("early_stopping_patience", _same),
    "lora_modules_to_save": ("additional_target", _same),       # TRL's ModelConfig
    "gradient_accumulation_steps": ("grad_accum", _same),
    "num_train_epochs": ("epochs", _same),
    "max_steps": ("steps", _max_steps),
    "warmup_ratio": ("warmup", _same),          # a fraction: `warmup` takes one below 1, as HF's warmup_steps does
    "warmup_steps": ("warmup", _same),
    "cutoff_len": ("seq", _same),
    "max_length": ("seq", _same),
    "new_special_tokens": ("add_special_tokens", _same),     # LlamaFactory's name before add_special_tokens
    "max_seq_length": ("seq", _same),
    "output_dir": ("run_dir", _same),
    "save_steps": ("save_every", _same),
    "save_total_limit": ("keep_last", _total_limit),
    "eval_steps": ("eval_every", _same),
    "logging_steps": ("log_every", _same),
    "report_to": ("log", _same),
    "model_name_or_path": ("model", _same),
    "adapter_name_or_path": ("adapter", _same),
    "run_name": ("name", _set),
    "adam_epsilon": ("eps", _same),
    "bf16": ("compute_dtype", _bf16),
    "fp16": ("compute_dtype", _fp16),
    "val_size": ("eval_fraction", _val_size),
    "resume_from_checkpoint": ("resume", _resume),
    "enable_thinking": ("chat_template_kwargs", _thinking),
    "preserve_thinking": ("chat_template_kwargs", _preserve),
    "use_dft_loss": ("loss_type", _dft),
    "use_eaft_loss": ("loss_type", _eaft),
    "kto_chosen_weight": ("desirable_weight", _same),       # LlamaFactory's names of TRL's KTO weights
    "kto_rejected_weight": ("undesirable_weight", _same),
    "pref_beta": ("beta", _same),                           # LlamaFactory's dpo and kto beta
    "dpo_label_smoothing": ("label_smoothing", _same),
    "chat_template_path": ("chat_template", _same),
    "preprocessing_num_workers": ("tokenize_workers", _same),
    "dataset_num_proc": ("tokenize_workers", _same),
    "use_cpu": ("device", lambda value: "cpu" if value is True else _DROP),     # transformers' TrainingArguments
    "train_sampling_strategy": ("disable_shuffling", _sampling),
}

# Read together with others below: adam_beta1/2 -> betas, lr_scheduler_type (+ _kwargs) ->
# schedule, min_lr (and warmup for HF's `constant`), template -> a check of the chat template.
SPECIAL = ("adam_beta1", "adam_beta2", "lr_scheduler_type", "lr_scheduler_kwargs", "template", "do_train",
           "eval_strategy", "evaluation_strategy", "save_strategy", "logging_strategy", "pref_loss",
           "packing_strategy", "neat_packing")

# Liger's kernels (TRL, LlamaFactory) and LlamaFactory's own: megacompile's fused kernels run in their place
KERNELS = ("enable_liger_kernel", "use_liger_kernel", "use_v1_kernels")
# TRL's ModelConfig keys whose choice the run makes itself
MODEL_CHOICES = ("attn_implementation", "lora_task_type")
IGNORED = ("trust_remote_code", "overwrite_cache", "overwrite_output_dir",
           "dataloader_num_workers", "save_only_model", "ddp_timeout", "flash_attn", "deepspeed",
           "do_eval", "gradient_checkpointing", "optim", "tf32", "pad_to_multiple_of",
           "tool_format", "buffer_size", "preprocessing_batch_size", "ignore_pad_token_for_loss",
           "data_shared_file_system", "eval_num_beams", "upcast_lmhead_output", "include_num_input_tokens_seen",
           "disable_gradient_checkpointing", "use_reentrant_gc", "low_cpu_mem_usage", "dataloader_pin_memory",
           "remove_unused_columns", "ddp_find_unused_parameters", "eval_accumulation_steps", "offload_folder",
           "use_cache", "print_param_status", "label_names", "gradient_checkpointing_kwargs", "torch_dtype", "dtype",
           *KERNELS, *MODEL_CHOICES, *trainer_args.NO_EFFECT,
           *their_llamafactory.NO_EFFECT)
WHY_IGNORED = {**{k: why for k, (_, why) in trainer_args.NO_EFFECT.items()},
               **{k: why for k, (_, why) in their_llamafactory.NO_EFFECT.items()},
               **{k: "megacompile's own fused Triton kernels run in their place (fuse: on by default on a GPU)"
                  for k in KERNELS},
               "attn_implementation": "attention runs as megacompile captured and planned it (its fused kernels on "
                                      "a GPU); the kernels compute the same attention",
               "lora_task_type": "the stage sets PEFT's task type (CAUSAL_LM; a reward model's score head trains "
                                 "whole)",
               "deepspeed": "megacompile places weights and optimizer state itself",
               "overwrite_output_dir": "a run_dir holding a run's checkpoints is never overwritten: resume: auto goes "
                                       "on from its latest and a new run there is refused (give it another "
                                       "output_dir)",
               "gradient_checkpointing": "the planner chooses what to recompute",
               "gradient_checkpointing_kwargs": "the planner chooses what to recompute",
               **{k: "the weights train in float32 masters; the compute's dtype is compute_dtype (bf16: true for "
                     "bfloat16)" for k in ("torch_dtype", "dtype")},
               "optim": "megacompile's AdamW is torch's",
               "pad_to_multiple_of": "a step's rows are cut to seq/8, seq/4, seq/2 or seq (trim_padding)",
               "tool_format": "tools are written by the model's chat template",
               "buffer_size": "streamed data is read in file order, with no shuffle buffer",
               "preprocessing_batch_size": "records are packed 1,000 at a time, LlamaFactory's default",
               "ignore_pad_token_for_loss": "padding is never counted",
               "eval_num_beams": "evaluation is the held-out loss; nothing is generated",
               "upcast_lmhead_output": "the loss's log-softmax runs in float32",
               "include_num_input_tokens_seen": "log.csv counts each step's tokens",
               "disable_gradient_checkpointing": "the planner chooses what to recompute",
               "use_reentrant_gc": "the planner chooses what to recompute",
               "low_cpu_mem_usage": "the model is built on the meta device and its weights streamed in",
               "dataloader_pin_memory": "the engine stages each batch itself",
               "remove_unused_columns": "a record's layout is read from its keys",
               "ddp_find_unused_parameters": "data parallelism reduces every gradient (docs/distributed.md)",
               "eval_accumulation_steps": "evaluation keeps no logits",
               "offload_folder": "megacompile places weights itself (nvme_dir for a disk tier)",
               "use_cache": "the KV cache is off while training; the export keeps the model's own setting",
               "print_param_status": "the run's start says what trains",
               "label_names": "the labels are the records' tokens"}

# HF schedule -> ours; `constant` has no warmup in transformers, `cosine_with_min_lr` needs a floor.
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant",
             "cosine_with_min_lr": "cosine"}
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_hf")


def own_key(key: str) -> str:
    """The run.yaml key whose value `key` replaces when given as an override (itself for
    megacompile's own keys, and for the aliases read together with others)."""
    if key in ALIASES:
        return ALIASES[key][0]
    return "schedule" if key == "lr_scheduler_type" else key


def named(error: ArgumentError, t: "Translated | dict[str, str]") -> ArgumentError:
    """`error` from the check of an own key, naming the alias the run.yaml gave it by (`t`: the
    translation, or its own key -> alias map, RunConfig.spelled)."""
    for own, spelled in (t if isinstance(t, dict) else t.spelled).items():
        if spelled != own and re.match(rf"{own}\b(?!_)", str(error)):
            return ArgumentError(f"{spelled} (megacompile's {own}): {error}")
    return error


class Translated:
    """The own keys an aliased run.yaml sets, the alias each came from, and the notes to print."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}
        self.spelled: dict[str, str] = {}
        self.written: dict[str, Any] = {}
        self.notes: list[str] = []

    def set(self, own: str, value: Any, spelled: str, written: Any) -> None:
        """`written`: the value as the file gave it, `value` as the own key takes it. The chat
        template's variables (chat_template_kwargs, enable_thinking, preserve_thinking) add up where
        none is given twice with two values."""
        if own == "chat_template_kwargs" and _disjoint(self.keys.get(own), value):
            value = {**self.keys[own], **value}
            self.written[own] = value
        elif own in self.keys and not _equal(self.keys[own], value):
            raise ArgumentError(f"{self.spelled[own]}: {_show(self.written[own])} and {spelled}: {_show(written)} set "
                                f"the same setting ({own}) to different values; give one of them")
        self.keys[own] = value
        self.spelled.setdefault(own, spelled)
        self.written.setdefault(own, written)


def translate(raw: dict, default_lr: float) -> Translated:
    """`raw` (a run.yaml's keys, overrides laid over them) under megacompile's own key names;
    `default_lr` is lr's default, for a min_lr_rate when no lr is given."""
    out = Translated()
    ignored = [k for k in raw if k in IGNORED and not trainer_args.at_default(k, raw[k])]
    for key, value in raw.items():
        if key == "max_length" and "cutoff_len" in raw:
            _generation_length(raw, out)
        elif _other_stages(key, value, raw.get("stage") or "sft"):
            continue        # LlamaFactory's default of another stage's key (temperature: 0.95, pref_beta: 0.1)
        elif key in ALIASES:
            own, convert = ALIASES[key]
            converted = convert(value)
            if converted is not _DROP:
                out.set(own, converted, key, value)
        elif (key in NOT_TAKEN or key in ZERO_IS_OFF) and off(value, key):
            continue        # neat_packing: false, push_to_hub: false, quantization_bit: null ask for nothing
        elif key in NOT_TAKEN and stage_note(key, raw.get("stage")):
            out.notes.append(stage_note(key, raw.get("stage")))     # padding_free under dpo, kto: nothing more
        elif key in ONLY_WITH and off(raw.get(ONLY_WITH[key]), ONLY_WITH[key]):
            continue        # hub_model_id without push_to_hub: a recipe's name for an upload it does not ask for
        elif key not in SPECIAL and key not in IGNORED:
            out.set(key, value, key, value)
    if "optim" in raw and raw["optim"] not in OPTIMIZERS:
        raise ArgumentError(f"optim {raw['optim']!r}: megacompile trains with AdamW (FP32 state on the host); "
                            f"give optim: adamw_torch or leave it out")
    if "do_train" in raw:
        _do_train(raw["do_train"])
    _betas(raw, out)
    _schedule(raw, out, default_lr)
    _strategies(raw, out)
    if "packing_strategy" in raw:
        _packing_strategy(raw["packing_strategy"], out)
    if "neat_packing" in raw:
        _neat_packing(raw["neat_packing"], out)
    if raw.get("pref_loss") is not None:
        _pref_loss(raw, out)
    if out.keys.get("steps") is not None and out.spelled.get("epochs") == "num_train_epochs":
        del out.keys["epochs"]      # transformers: max_steps > 0 overrides num_train_epochs
        out.notes.append("num_train_epochs is not used: max_steps is given (as in transformers)")
    if raw.get("template") is not None and raw.get("stage") == "pt":
        out.notes.append(f"template {raw['template']!r} is not read: stage pt renders no chat, each text is closed by "
                         "the tokenizer's EOS" + (" (LlamaFactory writes <|end_of_text|> under template llama3, which "
                                                  "is that EOS in Llama 3's base tokenizer)"
                                                  if raw["template"] == "llama3" else ""))
    elif raw.get("template") in LAYOUTS and not out.keys.get("chat_template"):
        out.set("template", raw["template"], "template", raw["template"])      # a layout rendered here
        eos = LAYOUTS[raw["template"]].eos
        out.notes.append(f"template {raw['template']!r}: chats are written in LlamaFactory's {raw['template']} layout "
                         "(megacompile/train/data/templates/)" + (f", {eos} made the EOS" if eos else "")
                         + "; the trained model is written with its folder's own chat template")
    elif raw.get("template") is not None:      # template: null is no template, as leaving it out
        out.notes.append(_template(raw["template"], out.keys))
    if ignored:
        why = [f"{k} ({WHY_IGNORED[k]})" if k in WHY_IGNORED else k for k in ignored]
        out.notes.append(f"ignored (no effect in a megacompile run): {', '.join(why)}")
    return out


def _other_stages(key: str, value: Any, stage: str) -> bool:
    """`key` at LlamaFactory's default under a stage that does not read it (their_llamafactory.STAGE_KEYS)."""
    default, stages = their_llamafactory.STAGE_KEYS.get(key, (None, (stage,)))
    return stage not in stages and not isinstance(value, bool) and _equal(value, default)


def _generation_length(raw: dict, out: Translated) -> None:
    """max_length beside cutoff_len: LlamaFactory's generation length (its GeneratingArguments,
    1024 by default), which its training does not read; cutoff_len is the row length. Alone,
    max_length is TRL's row length (seq)."""
    if not _equal(raw["max_length"], raw["cutoff_len"]):
        out.notes.append(f"max_length {_show(raw['max_length'])} is not read: beside cutoff_len it is LlamaFactory's "
                         "generation length, which its training does not read; cutoff_len "
                         f"{_show(raw['cutoff_len'])} is the row length (seq)")


# LlamaFactory's pref_loss values, each a loss type of stage dpo (orpo and simpo need no reference)
PREF_LOSSES = ("sigmoid", "hinge", "ipo", "orpo", "simpo")
PREF_LOSS_DEFAULT = "sigmoid"      # LlamaFactory's, which its dumps write under every stage


def _pref_loss(raw: dict, out: Translated) -> None:
    """LlamaFactory's pref_loss: stage dpo's loss_type where TRL has it; not read by stage kto,
    whose loss is its own, nor by the others (as in LlamaFactory): said in a note, except at its
    default under them."""
    value, stage = raw["pref_loss"], raw.get("stage") or "sft"
    if stage == "kto":
        out.notes.append(f"pref_loss {value!r} is not read by stage kto (as in LlamaFactory: its loss is KTO's)")
    elif stage != "dpo":
        if value != PREF_LOSS_DEFAULT:
            out.notes.append(f"pref_loss {value!r} is not read by stage {stage} (as in LlamaFactory: it is stage "
                             "dpo's loss)")
    elif value in PREF_LOSSES:
        # LlamaFactory's ORPO takes each pair's chosen NLL over its own tokens (loss_type orpo is TRL's)
        out.set("loss_type", "orpo_per_pair" if value == "orpo" else value, "pref_loss", value)
    else:
        raise ArgumentError(f"pref_loss takes {', '.join(PREF_LOSSES)} here (TRL's DPO loss types; loss_type names "
                            f"the others); got {value!r}")


def _betas(raw: dict, out: Translated) -> None:
    if "adam_beta1" not in raw and "adam_beta2" not in raw:
        return
    given = out.keys.get("betas")
    betas = list(given) if isinstance(given, (list, tuple)) and len(given) == 2 else [0.9, 0.999]
    for i, key in enumerate(("adam_beta1", "adam_beta2")):
        if key in raw:
            if given is not None and not _equal(betas[i], raw[key]):
                raise ArgumentError(f"betas: {_show(given)} and {key}: {_show(raw[key])} set the same setting to "
                                    "different values; give one of them")
            betas[i] = raw[key]
    out.keys["betas"] = betas
    out.spelled.setdefault("betas", "adam_beta1/adam_beta2")


def _schedule(raw: dict, out: Translated, default_lr: float) -> None:
    kind, kwargs = raw.get("lr_scheduler_type"), raw.get("lr_scheduler_kwargs") or {}
    if isinstance(kwargs, str):         # HF takes a JSON string on the command line
        try:
            kwargs = json.loads(kwargs)
        except ValueError as e:
            raise ArgumentError(f"lr_scheduler_kwargs is a mapping or a JSON object; got {kwargs!r}") from e
    if not isinstance(kwargs, dict):
        raise ArgumentError(f"lr_scheduler_kwargs is a mapping (min_lr or min_lr_rate); got {kwargs!r}")
    if kind is None:
        if kwargs:
            raise ArgumentError("lr_scheduler_kwargs without lr_scheduler_type: give lr_scheduler_type: "
                                "cosine_with_min_lr with min_lr or min_lr_rate, or megacompile's min_lr")
        return
    if kind not in SCHEDULES:
        raise ArgumentError(f"lr_scheduler_type {kind!r}: megacompile follows {', '.join(SCHEDULES)}; for another "
                            "shape give schedule: constant, linear or cosine with warmup and min_lr")
    out.set("schedule", SCHEDULES[kind], "lr_scheduler_type", kind)
    floors = {k: v for k, v in kwargs.items() if k in ("min_lr", "min_lr_rate")}
    other = {k: v for k, v in kwargs.items() if k not in floors and not (k == "num_cycles" and v == 0.5)}
    if other or (floors and kind != "cosine_with_min_lr"):
        raise ArgumentError(f"lr_scheduler_kwargs {kwargs!r}: megacompile takes min_lr or min_lr_rate, with "
                            "lr_scheduler_type: cosine_with_min_lr (a half cosine, num_cycles 0.5)")
    if kind == "cosine_with_min_lr":
        if len(floors) != 1:
            raise ArgumentError("lr_scheduler_type cosine_with_min_lr takes one of min_lr, min_lr_rate in "
                                f"lr_scheduler_kwargs; got {kwargs!r}")
        (name, written), = floors.items()
        value = written
        if name == "min_lr_rate":
            lr = out.keys.get("lr", default_lr)
            try:
                value = float(value) * float(lr)
            except (TypeError, ValueError) as e:
                raise ArgumentError(f"lr_scheduler_kwargs min_lr_rate must be a number; got {value!r}") from e
        out.set("min_lr", value, f"lr_scheduler_kwargs.{name}", written)
    if kind == "constant":          # transformers' constant schedule has no warmup
        warmup = out.keys.get("warmup")
        if warmup not in (None, 0, 0.0):
            out.notes.append(f"{out.spelled['warmup']}: {warmup} is not used: lr_scheduler_type constant has no "
                             "warmup in transformers (constant_with_warmup has)")
        out.keys["warmup"] = 0


HF_LOGGING_STEPS = 500     # transformers' default logging_steps, which eval_strategy: steps falls back on
HF_SAVE_STEPS = 500        # transformers' default save_steps


def _packing_strategy(strategy: Any, out: Translated) -> None:
    """TRL's packing_strategy, read with packing: true. TRL's default, bfd, keeps each packed
    document apart (its position ids restart, padding-free): megacompile's packing: isolated, whose
    rows are filled in the data's order rather than best-fit. wrapped cuts the token stream into rows
    regardless of documents: packing: true, LlamaFactory's packing. ffd, bfd's name in earlier TRL
    releases (first-fit decreasing), is read as bfd; bfd_split, which splits a document longer than
    a row across rows, is refused: a supervised record here is cut to its row."""
    if strategy == "bfd_split":
        raise ArgumentError("packing_strategy bfd_split splits a document longer than a row across rows; megacompile "
                            "cuts a supervised record to its row (as LlamaFactory cuts it) and keeps text flowing "
                            "across rows: give packing_strategy: bfd")
    if strategy not in ("bfd", "ffd", "wrapped"):
        raise ArgumentError(f"packing_strategy must be bfd (TRL's default: the documents kept apart; ffd, its earlier "
                            f"name) or wrapped (the token stream cut into rows); got {strategy!r}")
    if out.keys.get("packing") is True and strategy in ("bfd", "ffd"):
        out.keys["packing"] = "isolated"
        out.notes.append(f"packing: true with packing_strategy {strategy} keeps the packed documents apart, as TRL's "
                         f"{strategy} does (packing: isolated; rows are filled in the data's order, not best-fit)")


def _neat_packing(neat: Any, out: Translated) -> None:
    """LlamaFactory's neat_packing: packing with each packed document apart (its own attention, its
    position ids from 0), which turns packing on whatever `packing` says: megacompile's packing:
    isolated, whose rows are filled in the data's order rather than by LlamaFactory's knapsack."""
    if not isinstance(neat, bool):
        raise ArgumentError(f"neat_packing is true or false (LlamaFactory's: pack records, each kept apart); "
                            f"got {neat!r}")
    if not neat:
        return
    out.keys["packing"] = "isolated"
    out.spelled["packing"], out.written["packing"] = "neat_packing", True
    out.notes.append("neat_packing: the packed records are kept apart, each attending to itself with position ids "
                     "from 0, as LlamaFactory's neat_packing keeps them (packing: isolated; rows are filled in the "
                     "data's order, not by LlamaFactory's knapsack)")


def _strategies(raw: dict, out: Translated) -> None:
    for key, own in (("eval_strategy", "eval_every"), ("evaluation_strategy", "eval_every"),
                     ("save_strategy", "save_every"), ("logging_strategy", None)):
        if key not in raw:
            continue
        strategy = _strategy(key, own)(raw[key])
        if strategy == "no":
            out.keys.pop(own, None)
            # no eval; no checkpoint at all (save_every false), the trained model still written at the end
            out.keys[own] = None if own == "eval_every" else False
        elif strategy == "epoch":
            given = out.keys.get(own)
            if given not in (None, 0):
                out.notes.append(f"{out.spelled[own]}: {given} is not used: {key} is epoch (as in transformers)")
            out.keys[own] = intervals.EPOCH
            out.spelled.setdefault(own, key)
        elif own == "eval_every" and out.keys.get("eval_every") in (None, 0):
            # transformers: eval_steps unset (or 0) with eval_strategy steps is logging_steps
            every = out.keys.get("log_every", HF_LOGGING_STEPS)
            out.keys["eval_every"] = every
            out.spelled.setdefault("eval_every", key)
            out.notes.append(f"{key}: steps without eval_steps evaluates every {every} steps (logging_steps"
                             + ("" if "log_every" in out.keys else ", transformers' default")
                             + "), as transformers sets eval_steps")
        elif own == "save_every" and out.keys.get("save_every") is None:
            out.keys["save_every"] = HF_SAVE_STEPS
            out.spelled.setdefault("save_every", key)
            out.notes.append(f"{key}: steps without save_steps saves a checkpoint every {HF_SAVE_STEPS} steps "
                             "(transformers' default save_steps) and after the last")


def _template(name: Any, keys: dict) -> str:
    """LlamaFactory formats chats by a template name; megacompile by the tokenizer's own chat
    template, which it must then have."""
    where = keys.get("tokenizer") or keys.get("model")
    if name not in their_llamafactory.TEMPLATES:     # a typo: LlamaFactory refuses it too
        import difflib
        near = difflib.get_close_matches(str(name), sorted(their_llamafactory.TEMPLATES | set(LAYOUTS)), n=1)
        raise ArgumentError(f"template {name!r} is no template LlamaFactory has"
                            + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f"; megacompile renders {', '.join(LAYOUTS)} itself and formats other chats with the "
                            "tokenizer's own chat template: give one of those, or leave template out")
    if keys.get("chat_template"):
        return f"template {name!r} is not read: chats are formatted by chat_template ({keys['chat_template']})"
    if where == "bundled" or where is None:
        raise ArgumentError(f"template {name!r}: the bundled model reads bytes and has no chat template; leave "
                            "template out")
    if os.path.isdir(where) and not has_chat_template(where):
        raise ArgumentError(f"template {name!r}: megacompile formats chats with the tokenizer's own chat template, "
                            f"and {where} has none (chat_template in tokenizer_config.json or chat_template.jinja); "
                            "add one to the tokenizer folder, or leave template out for text data")
    return (f"template {name!r} is not read: chats are formatted by the tokenizer's own chat template "
            f"({where})")


def has_chat_template(folder: str) -> bool:
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return True
    for name in ("tokenizer_config.json", "chat_template.json"):
        try:
            with open(os.path.join(folder, name)) as f:
                if json.load(f).get("chat_template"):
                    return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _disjoint(a: Any, b: Any) -> bool:
    """Two mappings that set no variable to two values."""
    return isinstance(a, dict) and isinstance(b, dict) and all(_equal(a[k], b[k]) for k in a.keys() & b.keys())


def _equal(a: Any, b: Any) -> bool:
    """YAML reads 2e-5 (no dot) as a string: a number and its string are the same value."""
    if a == b:
        return True
    try:
        return float(a) == float(b) and not isinstance(a, bool) and not isinstance(b, bool)
    except (TypeError, ValueError):
        return False


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
