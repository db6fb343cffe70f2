"""LlamaFactory's keys for what megacompile does not do, by family, each with its default and why.
Its configs written by its web UI or copied from its examples carry many of them at their
defaults, which ask for nothing.

    KEYS       key -> (LlamaFactory's default, why it is not taken): refused away from the default,
               naming the reason (their_keys.py)
    NO_EFFECT  key -> (its default, why): keys its training does not read either (its inference and
               export commands', the ones it derives): accepted, named in the run's note of
               ignored keys away from the default (aliases.py)
    STAGE_KEYS key -> (its default, the stages that read it): keys of one stage that its dumps
               write under every stage (pref_beta) or that are its generation keys and name stage
               grpo's sampling keys (TRL's) too: at the default they ask for nothing under another
               stage (aliases.py). `max_length`, its generation length too, is the row length (seq)
               here unless cutoff_len is given beside it
    TEMPLATES  the names its `template:` takes (src/llamafactory/data/template.py's register_template,
               as of 2026-08): a name among them that megacompile does not render is noted, any
               other refused as LlamaFactory refuses it (aliases.py)
"""
from __future__ import annotations

from typing import Any

_OFT = "not supported: finetuning_type is full, freeze or lora (orthogonal fine-tuning, oft, is not)"
_PPO = "not supported: stage ppo is not (megacompile trains sft, pt, dpo, kto, rm and grpo)"
_REFERENCE = ("the reference of stage dpo and kto is the model folder's weights, the policy before training (TRL's "
              "ref_model); another reference model is not supported")
_OPTIMIZER = "not supported: megacompile trains with AdamW (float32 state in host memory)"
_SWANLAB = "not supported: log: takes csv, tensorboard and wandb"
_PARALLEL = ("megacompile places weights and optimizer state itself (data parallelism: torchrun, "
             "docs/distributed.md); Megatron and HyperParallel are not used")
_TOKENS = "add_tokens and add_special_tokens take the new tokens; their rows start as LlamaFactory's noise_init"
_QUANTIZED = "not supported: the weights train in float32 masters (quantization_bit is not taken)"
_AUDIO = "not supported: records hold text, images and videos; audio is not read"
_KT = "not supported: megacompile streams the weights itself (KTransformers is not used)"
_RAY = "not supported: a run is one process (or torchrun's, docs/distributed.md)"
_PROFILER = "megacompile writes each run's timeline itself: step.json in the run folder (trace: FILE for another)"
_FP8 = "not supported: compute_dtype is bfloat16 or float32, over float32 masters"

KEYS: dict[str, tuple[Any, str]] = {
    "oft_rank": (0, _OFT), "oft_block_size": (32, _OFT), "oft_target": ("all", _OFT), "module_dropout": (0.0, _OFT),
    "ppo_buffer_size": (1, _PPO), "ppo_epochs": (4, _PPO), "ppo_score_norm": (False, _PPO), "ppo_target": (6.0, _PPO),
    "ppo_whiten_rewards": (False, _PPO), "reward_model": (None, _PPO), "reward_model_adapters": (None, _PPO),
    "reward_model_quantization_bit": (None, _PPO), "reward_model_type": ("lora", _PPO),
    "ref_model": (None, _REFERENCE), "ref_model_adapters": (None, _REFERENCE),
    "ref_model_quantization_bit": (None, _REFERENCE),
    "galore_target": ("all", _OPTIMIZER), "galore_rank": (16, _OPTIMIZER), "galore_update_interval": (200, _OPTIMIZER),
    "galore_scale": (2.0, _OPTIMIZER), "galore_proj_type": ("std", _OPTIMIZER), "galore_layerwise": (False, _OPTIMIZER),
    "apollo_target": ("all", _OPTIMIZER), "apollo_rank": (16, _OPTIMIZER), "apollo_update_interval": (200, _OPTIMIZER),
    "apollo_scale": (32.0, _OPTIMIZER), "apollo_proj": ("random", _OPTIMIZER), "apollo_proj_type": ("std", _OPTIMIZER),
    "apollo_scale_type": ("channel", _OPTIMIZER), "apollo_layerwise": (False, _OPTIMIZER),
    "apollo_scale_front": (False, _OPTIMIZER),
    "badam_mode": ("layer", _OPTIMIZER), "badam_start_block": (None, _OPTIMIZER),
    "badam_switch_mode": ("ascending", _OPTIMIZER), "badam_switch_interval": (50, _OPTIMIZER),
    "badam_update_ratio": (0.05, _OPTIMIZER), "badam_mask_mode": ("adjacent", _OPTIMIZER),
    "badam_verbose": (0, _OPTIMIZER),
    "swanlab_workspace": (None, _SWANLAB), "swanlab_run_name": (None, _SWANLAB), "swanlab_mode": ("cloud", _SWANLAB),
    "swanlab_api_key": (None, _SWANLAB), "swanlab_logdir": (None, _SWANLAB),
    "swanlab_lark_webhook_url": (None, _SWANLAB),
    "swanlab_lark_secret": (None, _SWANLAB), "swanlab_project": ("llamafactory", _SWANLAB),
    "use_mca": (False, _PARALLEL), "use_megatron_bridge": (False, _PARALLEL), "megatron_bridge_args": (None, _PARALLEL),
    "use_hyper_parallel": (False, _PARALLEL), "hyper_parallel_args": (None, _PARALLEL),
    "hyper_parallel_cp_size": (1, _PARALLEL),
    "adapter_folder": (None, "adapter_name_or_path names the adapter folder to start from"),
    "new_special_tokens_config": (None, _TOKENS), "init_special_tokens": ("noise_init", _TOKENS),
    "ms_hub_token": (None, "megacompile reads local files and downloads nothing"),
    "om_hub_token": (None, "megacompile reads local files and downloads nothing"),
    "quantization_type": ("nf4", _QUANTIZED), "double_quantization": (True, _QUANTIZED),
    "quantization_device_map": (None, _QUANTIZED),
    "image_do_pan_and_scan": (False, "not supported: images are processed as the model folder's processor config "
                                     "says (Gemma 3's pan and scan is not turned on by run.yaml)"),
    "crop_to_patches": (False, "not supported: images are processed as the model folder's processor config says"),
    "use_audio_in_video": (False, _AUDIO), "audio_sampling_rate": (16000, _AUDIO),
    **{k: (None, _KT) for k in ("kt_cpu_activation", "kt_weight_path", "kt_non_expert_weight_path",
                                "kt_expert_checkpoint_path", "kt_use_lora_experts", "kt_lora_expert_num",
                                "kt_lora_expert_intermediate_size")},
    "ray_num_workers": (1, _RAY), "ray_init_kwargs": (None, _RAY),
    "enable_torch_profiler": (False, _PROFILER), "profiler_output_dir": (None, _PROFILER),
    "profiler_wait_steps": (1, _PROFILER), "profiler_warmup_steps": (1, _PROFILER),
    "profiler_active_steps": (1, _PROFILER), "profiler_repeat": (1, _PROFILER),
    "profiler_record_shapes": (True, _PROFILER), "profiler_profile_memory": (True, _PROFILER),
    "profiler_with_stack": (True, _PROFILER), "profile_modules": (None, _PROFILER),
    "fp8": (False, _FP8), "fp8_backend": ("auto", _FP8), "fp8_enable_fsdp_float8_all_gather": (False, _FP8),
}

_EXPORT = "LlamaFactory's export command's; export: FOLDER writes the trained model"
_INFERENCE = "LlamaFactory's inference's; serve the exported model with vLLM"
_DERIVED = "derived by LlamaFactory from its other keys"
_GENERATE = ("LlamaFactory's generation (its chat, and predict_with_generate's evaluation, which megacompile does "
             "not run); stage grpo samples with TRL's keys")
_SEQ2SEQ = "transformers' Seq2SeqTrainingArguments', read with predict_with_generate, which megacompile does not run"

NO_EFFECT: dict[str, tuple[Any, str]] = {
    "include_effective_tokens_per_second": (False, "log.csv writes each step's tokens and tokens_per_s"),
    "use_kv_cache": (True, _INFERENCE),
    **{k: (d, _INFERENCE) for k, d in (("vllm_maxlen", 4096), ("vllm_gpu_util", 0.7), ("vllm_enforce_eager", False),
                                       ("vllm_max_lora_rank", 32), ("vllm_config", None), ("sglang_maxlen", 4096),
                                       ("sglang_mem_fraction", 0.7), ("sglang_tp_size", -1), ("sglang_config", None),
                                       ("sglang_lora_backend", "triton"))},
    **{k: (d, _EXPORT) for k, d in (("export_size", 5), ("export_device", "cpu"), ("export_quantization_bit", None),
                                    ("export_quantization_dataset", None), ("export_quantization_nsamples", 128),
                                    ("export_quantization_maxlen", 1024), ("export_legacy_format", False),
                                    ("export_hub_model_id", None))},
    "device_map": (None, "megacompile places the model itself"),
    "model_max_length": (None, _DERIVED + " (cutoff_len here)"),
    "block_diag_attn": (False, _DERIVED + " (neat_packing: packing: isolated here)"),
    "master_addr": (None, "torchrun's rendezvous is read (docs/distributed.md)"),
    "master_port": (None, "torchrun's rendezvous is read (docs/distributed.md)"),
    **{k: (d, _GENERATE) for k, d in (("do_sample", True), ("num_beams", 1), ("max_new_tokens", 1024),
                                      ("length_penalty", 1.0), ("skip_special_tokens", True))},
    **{k: (None, _SEQ2SEQ) for k in ("generation_max_length", "generation_num_beams", "generation_config")},
    "sortish_sampler": (False, "transformers' Seq2SeqTrainingArguments', which its Trainer does not read"),
}

STAGE_KEYS: dict[str, tuple[Any, tuple[str, ...]]] = {
    **{k: (d, ("grpo",)) for k, d in (("temperature", 0.95), ("top_p", 0.7), ("top_k", 50),
                                      ("repetition_penalty", 1.0))},
    "pref_beta": (0.1, ("dpo", "kto", "grpo")), "dpo_label_smoothing": (0.0, ("dpo",)), "simpo_gamma": (0.5, ("dpo",)),
    "kto_chosen_weight": (1.0, ("kto",)), "kto_rejected_weight": (1.0, ("kto",)),
}

TEMPLATES = frozenset((
    "aeva", "alpaca", "bailing", "bailing_v2", "base", "breeze", "chatglm3", "chatml", "chatml_de", "cohere", "cpm4",
    "custom", "dbrx", "deepseek", "deepseek3", "deepseekcoder", "deepseekr1", "default", "dots_ocr", "empty",
    "ernie", "ernie_nothink", "ernie_vl", "exaone", "falcon", "falcon_h1", "fewshot", "gemma", "gemma2", "gemma3",
    "gemma3n", "gemma4", "gemma4n", "glm4", "glm4_5v", "glm4_7", "glm4_moe", "glm4v", "glm_ocr", "glmz1", "gpt_oss",
    "granite3", "granite3_vision", "granite4", "hunyuan", "hunyuan_small", "hy3", "hy_dense_1_8b", "hy_dense_7b",
    "index", "intern2", "intern_s1", "intern_vl", "keye_vl", "kimi_vl", "lfm2", "lfm2_vl", "llama2", "llama2_zh",
    "llama3", "llama4", "llava", "llava_next", "llava_next_llama3", "llava_next_mistral", "llava_next_qwen",
    "llava_next_video", "llava_next_video_mistral", "llava_next_video_yi", "llava_next_yi", "mimo", "mimo_v2",
    "mimo_vl", "minicpm_o", "minicpm_v", "minicpm_v_4_6", "minimax1", "minimax2", "ministral", "ministral3",
    "mistral", "mistral_small", "mllama", "moonlight", "moss_vl", "olmo", "openchat", "openchat-3.6", "opencoder",
    "paligemma", "paligemma_chat", "phi", "phi4", "phi4_mini", "phi_small", "pixtral", "qwen", "qwen2_audio",
    "qwen2_omni", "qwen2_vl", "qwen3", "qwen3_5", "qwen3_5_nothink", "qwen3_6", "qwen3_nothink", "qwen3_omni",
    "qwen3_omni_nothink", "qwen3_vl", "qwen3_vl_nothink", "sailor", "seed_coder", "seed_oss", "smollm", "smollm2",
    "solar", "starchat", "telechat2", "vicuna", "video_llava", "xuanyuan", "yi", "yi_vl", "youtu", "youtu_vl",
    "yuan", "zephyr"
))
