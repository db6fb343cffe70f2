"""Where a TRL or LlamaFactory config means something else here, or asks for what megacompile
does not do: said by name rather than left to an unknown-key list (refusals) or to a run that
quietly differs (notes printed at the start).

    NOT_TAKEN   their key -> megacompile's equivalent, or why it is not supported (refused unless
                its value is off: null, false, empty; 0 for ZERO_IS_OFF's keys; LlamaFactory's
                default, and only it, for DEFAULT_IS_OFF's)
    notes(c)    the differences of meaning a run states at its start (packing)
    stage_note  their key a stage takes, away from its default too, with a note (padding_free under
                dpo and kto)
"""
from __future__ import annotations

from typing import Any

from . import their_llamafactory, trainer_args

_LOCAL = "megacompile reads local files and downloads nothing"
_QUANTIZED = "not supported: the weights train in float32 masters; bitsandbytes' quantised loading is not used"
_PLACES = "megacompile places weights and optimizer state itself (data parallelism: torchrun, docs/distributed.md)"

NOT_TAKEN = {
    # data
    "dataset_name": f"give the data files as data: [train.jsonl, ...] ({_LOCAL})",
    "dataset_config": f"give the data files as data: ({_LOCAL})",
    "dataset_train_split": "give the training files as data: and the held-out ones as eval: (or eval_fraction)",
    "dataset_test_split": "give the held-out files as eval: (or eval_fraction)",
    "dataset_kwargs": "the record layout is found from the records' keys (docs/training.md, record layouts)",
    "tokenized_path": "token files are kept in the run folder (tokens/) and reused by a resumed run",
    # packing
    "padding_free": "not taken: TRL's flattens each batch of records into one row of their summed length, a new "
                    "shape at every step, and a run here plans one program per row shape (rows of seq); stage sft's "
                    "rows without padding are packing: isolated (records packed into rows of seq, kept apart by their "
                    "position ids); left out, a step's rows are cut after their longest record (trim_padding); "
                    "stages dpo and kto take padding_free: true, with a note",
    # model and tokenizer
    "model_init_kwargs": "the model is built from its folder's config.json; compute_dtype sets the dtype",
    "pad_token": "the tokenizer's own padding token is used (its eos when it has none); padding is never counted",
    "cache_dir": _LOCAL,
    "hf_hub_token": _LOCAL,
    "push_to_hub": "the trained model is written to output_dir (run_dir) or export; megacompile uploads nothing",
    "hub_model_id": "the trained model is written to output_dir (run_dir) or export; megacompile uploads nothing",
    # LoRA under TRL's script names
    "use_peft": "finetuning_type: lora",
    "lora_r": "lora_rank",
    "lora_target_modules": "lora_target",
    "lora_target_parameters": "not supported as a key: adapters go where lora_target names them, a "
                              "mixture-of-experts' stacked expert weights by their projections' names (gate_proj, "
                              "up_proj, down_proj) or all",
    "load_in_8bit": _QUANTIZED,
    "load_in_4bit": _QUANTIZED,
    "bnb_4bit_quant_type": _QUANTIZED,
    "use_bnb_nested_quant": _QUANTIZED,
    "bnb_4bit_quant_storage": _QUANTIZED,
    "loraplus_lr_embedding": "not supported: adapters sit on Linear modules alone (lora_target), none on an "
                             "embedding for it to apply to; its default, 1e-06, is taken",
    # kernels, precision, memory
    "quantization_bit": "not supported: the weights train in float32 masters; what does not fit the GPU streams "
                        "from host memory (host_budget) or disk (nvme_dir)",
    "quantization_method": "not supported: the weights train in float32 masters, streamed from the host",
    "use_unsloth": "not supported: megacompile runs its own fused kernels (fuse)",
    "auto_find_batch_size": "global_batch: the planner chooses the micro-batch that fits the budget",
    "fsdp": _PLACES,
    "fsdp_transformer_layer_cls_to_wrap": _PLACES,
    "pure_bf16": "not supported: megacompile keeps float32 masters; compute_dtype: bfloat16 is the compute",
    "upcast_layernorm": "not supported: the norms compute as the model's code has them (transformers' RMSNorm "
                        "upcasts to float32 itself)",
    "use_unsloth_gc": "the planner chooses what to recompute and what to offload to host memory",
    "shift_attn": "not supported: attention is the model's own (no shifted sparse attention)",
    "mixture_of_depths": "not supported: every token passes through every block",
    "use_kt": "not supported: megacompile streams the weights itself (KTransformers is not used)",
    "kt_optimize_rule": "not supported: megacompile streams the weights itself (KTransformers is not used)",
    "use_fast_tokenizer": "the tokenizer is transformers' AutoTokenizer, the fast one where the folder has it",
    "split_special_tokens": "not supported: special tokens are read as single tokens",
    "image_resolution": "image_max_pixels (LlamaFactory's current key; it bounds an image's pixel count)",
    # other optimisers and training methods
    "use_galore": "not supported: megacompile trains with AdamW (float32 state in host memory)",
    "use_apollo": "not supported: megacompile trains with AdamW (float32 state in host memory)",
    "use_badam": "not supported: megacompile trains with AdamW (float32 state in host memory)",
    "use_adam_mini": "not supported: megacompile trains with AdamW (float32 state in host memory)",
    "use_muon": "not supported: megacompile trains with AdamW (float32 state in host memory)",
    "use_asft_loss": "not supported: its KL term to the reference model reads the reference's whole distribution "
                     "at every token beside the policy's; its other term is loss_type dft (use_dft_loss)",
    "asft_alpha": "not supported: the weight of ASFT's KL term (use_asft_loss, not supported); its default, 0.1, is "
                  "taken",
    "pref_bco_weight": "not supported: DPO with BCO's term (LlamaFactory's pref_bco_weight); give pref_loss for "
                       "TRL's DPO loss types",
    "use_llama_pro": "not supported: finetuning_type: freeze trains chosen blocks of the model as it is",
    "create_new_adapter": "not supported: a LoRA run trains one adapter, a new one or the one adapter_name_or_path "
                          "gives; to train a new adapter over a trained one, merge that one into the model first",
    "group_by_length": "not supported: rows are ordered by seed, not by length",
    # evaluation and saving
    "save_safetensors": "weights are always written as safetensors",
    "predict_with_generate": "not supported: megacompile trains; generate with the exported model (transformers, "
                             "vLLM)",
    "do_predict": "not supported: megacompile trains; generate with the exported model (transformers, vLLM)",
    "export_dir": "export: FOLDER writes the trained model at the end of the run (LlamaFactory's export_dir "
                  "belongs to its export command)",
    "infer_backend": "not supported: megacompile trains; serve the exported model with transformers or vLLM",
    "infer_dtype": "not supported: megacompile trains; export_dtype sets the exported weights' dtype",
    # logging
    "logging_dir": "TensorBoard's logs go to the run folder's tensorboard/ (log: [tensorboard])",
    "use_swanlab": "not supported: log: takes csv, tensorboard and wandb",
    "ray_run_name": "not supported: a run is one process (or torchrun's, docs/distributed.md)",
    # DPO (LlamaFactory's names; pref_beta, pref_loss and dpo_label_smoothing are read: aliases.py)
}


# A TrainingArguments or TRL config dump's keys, refused away from the default it writes (trainer_args.py).
NOT_TAKEN.update({k: why for k, (_, why) in trainer_args.ASK_NOTHING.items() if why})
# LlamaFactory's keys of what megacompile does not do, refused away from its default (their_llamafactory.py).
NOT_TAKEN.update({k: why for k, (_, why) in their_llamafactory.KEYS.items()})

# Keys whose 0 asks for nothing: LlamaFactory's defaults, which its web UI writes into every saved
# run.yaml of the stage (pref_ftx under dpo and kto, which read a pref_ftx above 0).
ZERO_IS_OFF = ("pref_ftx", "pref_bco_weight")
# Keys whose LlamaFactory default asks for nothing more than megacompile does: accepted at that value.
DEFAULT_IS_OFF = {"use_fast_tokenizer": True, "infer_backend": "huggingface", "infer_dtype": "auto",
                  "loraplus_lr_embedding": 1e-6, "asft_alpha": 0.1, "bnb_4bit_quant_type": "nf4",
                  **{k: default for k, (default, _) in their_llamafactory.KEYS.items()
                     if default is not None and default is not False}}


# Keys a stage takes whatever their value, each with the note that says why it asks for nothing more there.
_TRIMMED = ("a step's rows here are cut after their longest {unit}'s last token, to seq/8, seq/4, seq/2 or seq "
            "(trim_padding, on by default)")
BY_STAGE = {"padding_free": {
    "dpo": "padding_free under stage dpo asks for nothing more: TRL 1.16's DPOTrainer turns it off (it warns and "
           "pads each batch to its longest row), and " + _TRIMMED.format(unit="pair"),
    "kto": "padding_free under stage kto asks for nothing more (KTOConfig has no such key; TRL's KTOTrainer pads "
           "each batch to its longest row): " + _TRIMMED.format(unit="example")}}


def stage_note(key: str, stage: Any) -> str | None:
    """The note of a key of theirs `stage` takes (BY_STAGE), None where it does not."""
    return BY_STAGE.get(key, {}).get(stage)


# Keys that ask for nothing while the key they serve is off (a recipe names its hub repository
# whether or not it uploads).
ONLY_WITH = {"hub_model_id": "push_to_hub"}


def off(value: Any, key: str | None = None) -> bool:
    """A value that asks for nothing (TRL's and LlamaFactory's defaults write most of these keys
    as null or false): such a key is accepted and does nothing."""
    if key in trainer_args.ASK_NOTHING and trainer_args.at_default(key, value):
        return True                 # a dump's default: eos_token: <EOS_TOKEN>
    if key in ZERO_IS_OFF and not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0:
        return True
    if key in DEFAULT_IS_OFF:       # its default alone: use_fast_tokenizer: false asks for another tokenizer
        return value is None or (type(value) is type(DEFAULT_IS_OFF[key]) and value == DEFAULT_IS_OFF[key])
    return value is None or value is False or value in ("", [], {})


def refusal(unknown: list[str]) -> str | None:
    """For the unknown keys that are TRL's or LlamaFactory's: their equivalents or why they are not
    supported, one clause each; None when there is none of theirs."""
    told = [f"{k} -> {NOT_TAKEN[k]}" for k in unknown if k in NOT_TAKEN]
    return "; ".join(told) if told else None


def notes(c: Any, given: dict) -> list[str]:
    """One line per setting whose meaning here differs from TRL's or LlamaFactory's (not an error);
    `given`: the keys the run.yaml and the command line set."""
    kept = _kept_checkpoints(c, given)
    if c.stage == "pt":
        return kept + _pretraining(c, given)
    if c.stage != "sft" or c.bundled:
        return kept
    if c.packing is None:
        return kept + ["packing not given: supervised records (chat, Alpaca, prompt/completion) are not packed, one a "
                       "row truncated to seq, as in LlamaFactory's and TRL's SFT; plain-text documents fill rows end "
                       "to end and continue across them, as in LlamaFactory's stage pt (TRL cuts each at max_length)"]
    if c.packing is True:
        return kept + ["packing: true packs records whole, as LlamaFactory's packing (without neat_packing): packed "
                       "documents attend to each other; TRL's packing: true keeps them apart, which is packing: "
                       "isolated here"]
    return kept


def _kept_checkpoints(c: Any, given: dict) -> list[str]:
    """The Trainer keeps every checkpoint-N unless save_total_limit says otherwise; a run here keeps
    keep_last's (3 by default: each holds the fp32 masters and AdamW moments, 12 B a parameter). Said
    where the run.yaml asks for checkpoints in the Trainer's words and leaves the count out."""
    asked = (getattr(c, "spelled", None) or {}).get("save_every") in ("save_steps", "save_strategy")
    if not asked or "keep_last" in given or c.keep_last is None:
        return []
    return [f"save_total_limit not given: the {c.keep_last} latest checkpoints are kept (keep_last {c.keep_last}; "
            "each holds the fp32 masters and AdamW moments), older ones removed as the run saves, where the Trainer "
            "keeps every checkpoint-N; give save_total_limit: null to keep them all"]


# Keys that shape a chat's tokens, which stage pt (each record read as its text) does not render.
CHAT_KEYS = ("train_on_prompt", "assistant_only_loss", "completion_only_loss", "mask_history", "chat_template",
             "chat_template_kwargs", "tools", "default_system")


def _pretraining(c: Any, given: dict) -> list[str]:
    out = ["stage pt: each record is one text (LlamaFactory's pretraining reading, docs/training.md), closed by the "
           "tokenizer's EOS and every token trained; the texts fill rows end to end and continue across them, as "
           "LlamaFactory's packing under stage pt" + (" (packing: false here starts each text on a row of its own "
                                                      "and continues it over as many rows as it takes, where "
                                                      "LlamaFactory cuts it at cutoff_len)" if c.packing is False
                                                      else "")]
    unused = [k for k in CHAT_KEYS if given.get(k) not in (None, False, [], {})]
    if unused:
        out.append(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not used under stage pt: no chat is "
                   "rendered, and every token trains")
    return out
