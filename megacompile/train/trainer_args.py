"""The keys a dump of transformers' TrainingArguments or of a TRL config (`SFTConfig(...).to_dict()`,
the training_args a Trainer run saves) writes that megacompile does not read.

A dump writes every field, most at their defaults: each such key is accepted at its default (it
asks for nothing), in one of two groups.

    ASK_NOTHING  at its default (or off: null, false, empty, as their_keys.off reads them) it is
                 accepted and does nothing; another value asks for what megacompile does not do,
                 and is refused, naming why (their_keys.NOT_TAKEN)
    NO_EFFECT    any value changes nothing a run trains (logging, the hub, dataloader workers,
                 DDP's tuning): accepted, and named in the run's note of ignored keys when it is
                 not its default

`*_token` fields are written masked (`<EOS_TOKEN>`, `<HUB_TOKEN>`): the masks read as unset.
Defaults are those of transformers 5 and TRL 1.x.
"""
from __future__ import annotations

from typing import Any

from . import their_llamafactory

_ROUTER_LOSS = "moe_aux_loss_coef: VALUE turns the routers' load-balancing loss on at that weight (LlamaFactory's key)"
_COMPILE = "megacompile compiles the step itself (fuse: true runs its fused kernels)"
_PLACES = "megacompile places weights and optimizer state itself (data parallelism: torchrun, docs/distributed.md)"
_EVAL = "evaluation is the held-out loss"
_HUB = "megacompile uploads nothing"
_LOGS = "the run's own progress lines and log.csv"
_PLANNER = "the planner chooses what to recompute and what to offload to host memory"

# key -> (its default or defaults, why another value is refused)
ASK_NOTHING: dict[str, tuple[tuple, str]] = {
    "torch_compile": ((False,), _COMPILE),
    "torch_compile_backend": ((None,), _COMPILE),
    "torch_compile_mode": ((None,), _COMPILE),
    "fsdp_config": ((None,), _PLACES),
    "parallelism_config": ((None,), _PLACES),
    "bf16_full_eval": ((False,), "evaluation runs in compute_dtype"),
    "fp16_full_eval": ((False,), "evaluation runs in compute_dtype"),
    "data_seed": ((None,), "seed sets the data order"),
    "dataloader_drop_last": ((False,), "not supported: no batch is dropped"),
    "dataloader_in_order": ((True,), "rows are ordered by seed"),
    "debug": (("", []), "not supported: transformers' debug modes"),
    "eval_delay": ((0,), "evaluation runs every eval_every steps"),
    "eval_packing": ((None,), "held-out rows are packed as the training rows are (packing)"),
    "full_determinism": ((False,), "not supported: seed sets the data order and initialisation; torch's "
                                   "deterministic algorithms are not forced"),
    "ignore_data_skip": ((False,), "not supported: a resumed run continues from its data position"),
    "label_smoothing_factor": ((0, 0.0), "not supported: the cross-entropy is not smoothed"),
    "length_column_name": (("length",), "not supported: rows are ordered by seed, not by length"),
    "liger_kernel_config": ((None,), "fuse: true runs megacompile's own fused kernels"),
    "optim_args": ((None,), "megacompile trains with AdamW; its betas, eps and weight_decay are keys of their own"),
    "optim_target_modules": ((None,), "not supported: megacompile trains with AdamW"),
    "router_aux_loss_coef": ((None,), _ROUTER_LOSS),
    "precompute_ref_batch_size": ((None,), "the reference pass runs batch rows at a time"),
    # GRPO (TRL 1.16): what stage grpo does not do
    "use_adaptive_entropy": ((False,), "not supported: the entropy bonus's coefficient is entropy_coef, fixed "
                                       "through the run"),
    "cast_lm_head_to_fp32": ((False,), "not supported: the lm head runs in compute_dtype, its log-probabilities "
                                       "are taken in fp32"),
    "max_tool_calling_iterations": ((None,), "not supported: completions make no tool calls"),
    "vllm_tensor_parallel_size": ((1,), "vllm_mode colocate runs vLLM on this process's GPU; a policy split over "
                                        "GPUs: vllm_mode server (vllm serve --tensor-parallel-size)"),
    "vllm_structured_outputs_regex": ((None,), "not supported: completions are not constrained"),
    # TRL's ModelConfig: the hub's default branch, which asks for nothing of a local folder
    "model_revision": (("main",), "megacompile reads local files and downloads nothing"),
    # their_keys.NOT_TAKEN's own, at the default a dump writes
    "eos_token": (("<EOS_TOKEN>",), ""),
    "pad_token": (("<PAD_TOKEN>",), ""),
}

# key -> (its default or defaults, why no value changes what is trained)
NO_EFFECT: dict[str, tuple[tuple, str]] = {
    "disable_tqdm": ((False,), _LOGS),
    "log_level": (("passive",), _LOGS),
    "log_level_replica": (("warning",), _LOGS),
    "log_on_each_node": ((True,), _LOGS),
    "logging_first_step": ((False,), "log.csv records every log_every steps"),
    "logging_nan_inf_filter": ((True,), "a step's loss is logged as it is"),
    "skip_memory_metrics": ((True,), "the plan and the log say the run's memory"),
    "project": (("huggingface",), "log: takes csv, tensorboard and wandb"),
    "trackio_bucket_id": ((None,), "log: takes csv, tensorboard and wandb"),
    "trackio_space_id": ((None,), "log: takes csv, tensorboard and wandb"),
    "trackio_static_space_id": ((None,), "log: takes csv, tensorboard and wandb"),
    "hub_always_push": ((False,), _HUB),
    "hub_private_repo": ((None,), _HUB),
    "hub_revision": ((None,), _HUB),
    "hub_strategy": (("every_save",), _HUB),
    "hub_token": ((None, "<HUB_TOKEN>"), _HUB),
    "local_rank": ((-1,), "torchrun's environment gives the rank"),
    "dataloader_multiprocessing_context": ((None,), "the engine stages each batch itself"),
    "dataloader_persistent_workers": ((False,), "the engine stages each batch itself"),
    "dataloader_prefetch_factor": ((None,), "the engine stages each batch itself"),
    "ddp_backend": ((None,), "data parallelism is megacompile's own (docs/distributed.md)"),
    "ddp_broadcast_buffers": ((None,), "data parallelism is megacompile's own (docs/distributed.md)"),
    "ddp_bucket_cap_mb": ((None,), "data parallelism is megacompile's own (docs/distributed.md)"),
    "ddp_static_graph": ((None,), "data parallelism is megacompile's own (docs/distributed.md)"),
    "average_tokens_across_devices": ((True,), "one process trains the batch's mean; under torchrun, "
                                               "docs/distributed.md says how the ranks' losses combine"),
    "eval_do_concat_batches": ((True,), _EVAL),
    "eval_use_gather_object": ((False,), _EVAL),
    "batch_eval_metrics": ((False,), _EVAL),
    "include_for_metrics": (([],), _EVAL),
    "prediction_loss_only": ((False,), _EVAL),
    "save_on_each_node": ((False,), "a checkpoint is written once"),
    "torch_empty_cache_steps": ((None,), "the device arena is megacompile's own"),
    "restore_callback_states_from_checkpoint": ((False,), "a resumed run restores its own state"),
    "enable_jit_checkpoint": ((False,), "a stop signal always ends a run with a checkpoint (preemption)"),
    "accelerator_config": (({"split_batches": False, "dispatch_batches": None, "even_batches": True,
                             "use_seedable_sampler": True, "non_blocking": False,
                             "gradient_accumulation_kwargs": None},), "accelerate is not used"),
    "activation_checkpointing": ((True, False), _PLANNER),
    "activation_checkpointing_kwargs": ((None,), _PLANNER),
    "activation_offloading": ((False,), _PLANNER),
    "shuffle_dataset": ((False, True), "rows are ordered by seed"),
    # GRPO (TRL 1.16)
    "entropy_coef_delta": ((0.005,), "read only with use_adaptive_entropy, which is not supported"),
    "entropy_coef_max": ((1.0,), "read only with use_adaptive_entropy, which is not supported"),
    "entropy_coef_min": ((0.0,), "read only with use_adaptive_entropy, which is not supported"),
    "entropy_target": ((0.2,), "read only with use_adaptive_entropy, which is not supported"),
    "vllm_group_port": ((51216,), "the weights reach vLLM in this process or through files, not a NCCL group"),
    "ds3_gather_for_generation": ((True,), _PLACES),
    "cache_implementation": ((None,), "the generator keeps its own key-value cache"),
    "use_transformers_paged": ((False,), "the generator is run.yaml's generator or use_vllm"),
    "use_transformers_continuous_batching": ((False,), "the generator is run.yaml's generator or use_vllm"),
    "transformers_continuous_batching_config": ((None,), "the generator is run.yaml's generator or use_vllm"),
    "log_completions_hub_repo": ((None,), _LOGS),
    "log_multimodal": ((True,), _LOGS),
    "log_unique_prompts": ((False,), _LOGS),
}


# The defaults a dump writes of keys the run's note of ignored keys names with reasons of its own
# (aliases.IGNORED): at these values they are not named.
QUIET = {"dataloader_num_workers": (0,), "dataloader_pin_memory": (True, False), "ddp_find_unused_parameters": (None,),
         "ddp_timeout": (1800,), "deepspeed": (None,), "do_eval": (False,), "eval_accumulation_steps": (None,),
         "gradient_checkpointing": (True, False), "include_num_input_tokens_seen": ("no", False),
         "label_names": (None,), "optim": ("adamw_torch_fused", "adamw_torch"), "pad_to_multiple_of": (None,),
         "remove_unused_columns": (True, False), "save_only_model": (False,),
         "tf32": (None,), "trust_remote_code": (False,), "use_cache": (False, True),
         "enable_liger_kernel": (False,), "use_liger_kernel": (False,), "use_v1_kernels": (False,),
         "attn_implementation": (None,), "lora_task_type": ("CAUSAL_LM",), "gradient_checkpointing_kwargs": (None,),
         "torch_dtype": (None, "auto", "float32"), "dtype": (None, "auto", "float32")}


def at_default(key: str, value: Any) -> bool:
    """`value` is one of the defaults a dump writes for `key` (a bool is not taken for a number)."""
    table = ASK_NOTHING.get(key) or NO_EFFECT.get(key)
    defaults = table[0] if table is not None else QUIET.get(key, ())
    if key in their_llamafactory.NO_EFFECT:      # LlamaFactory's default, and null
        defaults = (their_llamafactory.NO_EFFECT[key][0], None)
    return any(type(value) is type(d) and value == d for d in defaults)
