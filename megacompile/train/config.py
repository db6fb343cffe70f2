"""run.yaml: every key, its default and its check. A run's settings are read from the file, the
command line's `key=value` overrides are laid over them, and every key is checked (type, range,
files that must exist, keys that exclude each other) before a model, tokenizer or data file is
opened: a bad run fails in a second, naming the key, what it got and what it takes. The data keys
are checked in config_data.py, single values (a number in a range, a flag) in config_values.py.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

import torch

from .. import arguments
from . import aliases
from .config_data import check_data, check_media, lay_tools
from .config_values import choice, flag, folder_or_file, integer, loggers, number, numeric, text, warmup
from .data import entries
from . import preemption
from . import best_model, early_stopping, neftune, rope_scaling, router_loss, vocab
from . import intervals
from . import eos_token, their_keys
from ..errors import ArgumentError
from ..optim import MAX_LR
from ..settings import Settings
from .schedule import warmup_steps

SCHEDULES = ("constant", "linear", "cosine")
PACKING = (False, True, "isolated")
DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")
BUNDLED = entries.BUNDLED
BUNDLED_MODEL = {"dim": 384, "layers": 6, "heads": 6, "kv_heads": 2, "ffn": 1024}
DROPOUT_OFF = ("dpo", "kto", "rm")      # the stages whose TRL and LlamaFactory trainers disable dropout


@dataclass
class RunConfig:
    """One run's settings; docs/training.md explains each key."""
    model: str = BUNDLED
    tokenizer: str | None = None
    eos_token: str | None = None    # TRL's: taken where it is the tokenizer's own EOS (eos_token.py)
    bundled_model: dict = field(default_factory=lambda: dict(BUNDLED_MODEL))
    data: list = field(default_factory=lambda: [BUNDLED])
    mix_strategy: str | None = None
    interleave_probs: Any = None
    dataset: Any = None
    eval_dataset: Any = None
    dataset_dir: str | None = None
    media_dir: str | None = None    # LlamaFactory's: the folder records' image and video paths are relative to
    streaming: bool = False
    max_samples: int | None = None
    eval: list = field(default_factory=list)
    eval_fraction: float = 0.0
    train_on_prompt: bool = False
    assistant_only_loss: bool | None = None     # TRL's: a conversation's loss on its assistant turns (data/encoding.py)
    completion_only_loss: bool | None = None    # TRL's: a prompt/completion record's loss on its completion
    mask_history: bool = False      # LlamaFactory's: the last answer of a conversation alone trains
    chat_template: str | None = None            # a template file or folder in place of the tokenizer's
    template: str | None = None                 # LlamaFactory's name of a layout rendered here (data/named_template.py)
    default_system: str | None = None           # LlamaFactory's: the system message of chats without one
    chat_template_kwargs: dict | None = None    # handed to the chat template (data/tools.py)
    tools: list | str | None = None             # TRL's DPOConfig.tools: every conversation's, unless it gives its own
    dataset_text_field: str | None = None       # TRL's: the column text records are read from
    tokenize_workers: int | None = 1            # processes that make the token files (data/workers.py)
    seq: int = 512
    packing: bool | str | None = None     # unset: text packed, supervised records one a row (placement.py)
    global_batch: int | None = None
    batch: int = 1
    grad_accum: int = 1
    accumulation: str = Settings.accumulation
    updates: str = Settings.updates
    lr: float = 2e-5
    warmup: int = 0
    schedule: str = "cosine"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    hbm_budget: float | None = None
    budget_fraction: float = 0.5
    host_budget: float | None = None
    nvme_dir: str | None = None
    nvme_budget: float | None = None
    compute_dtype: str = "float32"
    device: str | None = None
    fuse: bool | None = Settings.fuse
    on_nonfinite: str = Settings.on_nonfinite
    max_consecutive_skips: int | None = 50
    stop_signals: list = field(default_factory=lambda: list(preemption.DEFAULT))
    retrace: bool = Settings.retrace
    dump_dir: str | None = None
    steps: int | None = None
    epochs: float | None = None
    eval_every: int | float | str | None = None     # steps, a fraction of them, or epoch (intervals.py)
    eval_batches: int | None = None     # at most this many eval batches an evaluation
    eval_batch: int | None = None       # rows an eval batch, as the Trainer averages them (held_out.py); None: batch
    save_every: int | float | str | bool | None = None      # as eval_every; false: no checkpoint (save_strategy: no)
    keep_last: int | None = 3
    resume: str | None = None
    run_dir: str | None = None
    name: str = "train"
    log: list = field(default_factory=lambda: ["csv"])
    wandb_project: str | None = None
    log_every: int | float = 10
    export: str | None = None
    export_dtype: str = "float32"
    seed: int = 0
    # which parameters train (train/methods/)
    finetuning_type: str = "full"
    lora_rank: int = 8
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    use_dora: bool = False              # DoRA: a learned magnitude per output beside each adapter (PEFT's)
    pissa_init: bool = False            # PiSSA: adapters start as each weight's principal part (methods/pissa.py)
    pissa_iter: int = 16                # its randomised SVD's iterations; -1: the full SVD
    pissa_convert: bool = False         # the exported adapter is always converted (methods/pissa.py)
    use_rslora: bool = False            # rank-stabilised LoRA: the adapters' scale is lora_alpha / sqrt(lora_rank)
    loraplus_lr_ratio: float | None = None   # LoRA+: the adapters' B (and trained 1-D parameters) at lr x this
    additional_target: Any = None       # LoRA: modules trained whole beside the adapters (PEFT's modules_to_save)
    moe_aux_loss_coef: float | None = None   # the routers' load-balancing loss on, at this weight (router_loss.py)
    neftune_noise_alpha: float | None = None   # NEFTune's noise on the input embeddings (neftune.py)
    rope_scaling: str | None = None     # linear, yarn or llama3: the rotary embedding stretched to seq (rope_scaling.py)
    add_tokens: Any = None              # tokens added to the tokenizer (vocab.py)
    add_special_tokens: Any = None      # special tokens added to the tokenizer (vocab.py)
    resize_vocab: bool = False          # the model's rows grown to the tokenizer's (vocab.py)
    load_best_model_at_end: bool = False    # the model written is the best checkpoint's (best_model.py)
    metric_for_best_model: str | None = None    # its evaluation metric (eval_loss by default)
    greater_is_better: bool | None = None       # None: lower is better for a loss, higher for the rest
    # stop after this many evaluations without improvement (early_stopping.py)
    early_stopping_patience: int | None = None
    compute_accuracy: bool = False      # LlamaFactory's: the held-out token accuracy beside the loss (stage sft)
    eval_on_each_dataset: bool = False  # LlamaFactory's: each eval file (eval_dataset name) evaluated on its own too
    eval_on_start: bool = False         # transformers': an evaluation before the first step (intervals.evaluates)
    plot_loss: bool = False     # LlamaFactory's: training_loss.png at the end (loss_plot.py)
    # what the run makes of the three (io/grown_vocab.py's GrownVocab, vocab.resolve); no key of run.yaml
    grown: Any = field(default=None, metadata={"derived": True})
    # pissa_init's initial adapters: the run folder's file a resumed run reads them from (None: made
    # from the weights), and what they make of the base (methods/pissa.py's Residual); no keys of run.yaml
    pissa_kept: Any = field(default=None, metadata={"derived": True})
    pissa: Any = field(default=None, metadata={"derived": True})
    # the settings as given, paths made absolute and overrides laid over: the run folder's
    # training_args.yaml (run_args.py), which `megacompile export` reads the run back from
    given: Any = field(default=None, compare=False, repr=False, metadata={"derived": True})
    # own key -> the name the run.yaml gave it by (cutoff_len for seq): a refusal after the checks
    # names the key as written (aliases.named)
    spelled: Any = field(default=None, compare=False, repr=False, metadata={"derived": True})
    disable_shuffling: bool = False   # LlamaFactory's: documents in the files' order, rows in stream order
    trim_padding: bool = True     # a step's rows cut after their longest document (data/trim.py)
    train_from_scratch: bool = False   # LlamaFactory's: the model folder's config, randomly initialised
    # TRL's: every nn.Dropout of the model at p 0 (model.disable_dropout); None: true under stage
    # dpo, kto and rm, as TRL's and LlamaFactory's trainers of them default, false otherwise
    disable_dropout: bool | None = None
    lora_target: Any = "all"
    merge_adapter: bool = False
    adapter: str | None = None          # a LoRA adapter folder (PEFT's) the run's adapters start from
    freeze_trainable_layers: int = 2
    freeze_trainable_modules: Any = "all"
    freeze_extra_modules: Any = None
    # a vision-language model's parts (train/methods/vision_freeze.py)
    freeze_vision_tower: bool | None = None
    freeze_multi_modal_projector: bool | None = None
    freeze_language_model: bool | None = None
    # images and videos of a vision-language model's records (LlamaFactory's names; train/data/pixels.py)
    image_max_pixels: int | None = None
    image_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_min_pixels: int | None = None
    video_fps: float | None = None
    video_maxlen: int | None = None
    # post-training (train/stages/keys.py): TRL's names; None is the stage's default
    stage: str = "sft"
    beta: float | None = None
    label_smoothing: float | None = None
    loss_type: Any = None
    eaft_alpha: Any = None              # loss_type eaft's power on the entropy weight (stages/keys.py)
    loss_weights: Any = None
    precompute_ref_log_probs: bool | None = None
    rpo_alpha: float | None = None
    pref_ftx: float | None = None
    discopop_tau: float | None = None
    simpo_gamma: float | None = None
    f_divergence_type: str | None = None
    f_alpha_divergence_coef: float | None = None
    use_weighting: bool | None = None
    ld_alpha: float | None = None
    desirable_weight: float | None = None
    undesirable_weight: float | None = None
    center_rewards_coefficient: float | None = None
    num_generations: int | None = None
    num_generations_eval: int | None = None
    sync_ref_model: bool | None = None
    ref_model_mixup_alpha: float | None = None
    ref_model_sync_steps: int | None = None
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    truncation_mode: str | None = None      # stage dpo's and kto's (stages/truncation.py)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    generation_kwargs: Any = None
    epsilon: float | None = None
    epsilon_high: float | None = None
    sapo_temperature_pos: float | None = None
    sapo_temperature_neg: float | None = None
    entropy_coef: float | None = None
    log_completions: bool | None = None
    num_completions_to_print: int | None = None
    vespo_k_pos: float | None = None
    vespo_lambda_pos: float | None = None
    vespo_k_neg: float | None = None
    vespo_lambda_neg: float | None = None
    reward_funcs: Any = None
    reward_weights: Any = None
    num_iterations: int | None = None
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    scale_rewards: Any = None
    multi_objective_aggregation: str | None = None
    off_policy_mask_threshold: float | None = None
    mask_truncated_completions: bool | None = None
    use_bias_correction_kl: bool | None = None
    importance_sampling_level: str | None = None
    delta: float | None = None
    top_entropy_quantile: float | None = None
    generator: str | None = None
    generator_dtype: str | None = None
    use_vllm: bool | None = None
    vllm_mode: str | None = None
    vllm_server_base_url: str | None = None
    vllm_server_host: str | None = None
    vllm_server_port: int | None = None
    vllm_server_timeout: float | None = None
    vllm_max_model_length: int | None = None
    vllm_model_impl: str | None = None
    vllm_enable_sleep_mode: bool | None = None
    vllm_gpu_memory_utilization: float | None = None
    vllm_importance_sampling_correction: bool | None = None
    vllm_importance_sampling_mode: str | None = None
    vllm_importance_sampling_clip_max: float | None = None
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_cap: float | None = None        # TRL's old name of clip_max

    @property
    def bundled(self) -> bool:
        return self.model == BUNDLED

    def settings(self) -> Settings:
        """The run's compile() settings, checked by the one check (megacompile/settings.py): the
        keys are compile()'s own names, so its errors name the run.yaml key."""
        return Settings(hbm_budget=self.hbm_budget, compute_dtype=getattr(torch, self.compute_dtype),
                        device=self.device, retrace=self.retrace, dump_dir=self.dump_dir, grad_accum=self.grad_accum,
                        fuse=self.fuse, host_budget=self.host_budget, on_nonfinite=self.on_nonfinite,
                        nvme_dir=self.nvme_dir, nvme_budget=self.nvme_budget, accumulation=self.accumulation,
                        updates=self.updates)


KEYS = tuple(f.name for f in fields(RunConfig) if not f.metadata.get("derived"))


def embedded_default_path() -> str:
    """The run.yaml that `megacompile train` without --config runs: the bundled model and corpus."""
    return str(resources.files("megacompile.train").joinpath("default.yaml"))


def load(path: str | None, overrides: list[str] = (), model_only: bool = False) -> RunConfig:
    """Settings from `path` (the embedded default when None) with `key=value` overrides, checked.
    model_only: for what reads the run's model alone (megacompile export): the model, tokenizer and
    template are checked as for a run, the data, eval, media_dir, tools, resume, adapter and
    reward_funcs keys as values, the files they name neither looked for nor read nor imported (a
    run's data gone since it trained)."""
    import yaml
    path = path or embedded_default_path()
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ArgumentError(f"cannot read the run config {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ArgumentError(f"{path} is not valid YAML: {e}") from e
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ArgumentError(f"{path} must hold a mapping of keys (model: ..., data: ...), not a "
                            f"{type(raw).__name__}")
    base = os.path.dirname(os.path.abspath(path))
    from_cwd: list[str] = []      # inputs found from the working directory alone (_beside_or_here)
    raw = {k: _beside_or_here(aliases.own_key(k), v, _relative(aliases.own_key(k), v, base), from_cwd)
           for k, v in raw.items()}
    in_file, overridden = set(raw), set()
    for item in overrides:
        key, value = _override(item)
        if "." in key:      # bundled_model.dim=64
            outer, inner = key.split(".", 1)
            if not isinstance(raw.get(outer, {}), dict) and outer in KEYS:
                raise ArgumentError(f"override {item!r}: {outer} is not a mapping")
            raw.setdefault(outer, {})[inner] = value
        else:       # in place of the file's value, whichever name either gives it (learning_rate, lr)
            for old in [k for k in in_file if aliases.own_key(k) == aliases.own_key(key)]:
                del raw[old]
                in_file.discard(old)
            raw[key] = value
            overridden.add(key)
    if ("dataset" in raw or "eval_dataset" in raw) and raw.get("dataset_dir") is None:
        # LlamaFactory's default, beside the file like any path (or in the working directory, where
        # LlamaFactory reads it, when only there)
        raw["dataset_dir"] = _beside_or_here("dataset_dir", "data", os.path.join(base, "data"), from_cwd)
    own = aliases.translate(raw, RunConfig.lr)
    try:
        c = check(own.keys, source=path, model_only=model_only)
    except ArgumentError as e:
        raise aliases.named(e, own) from e
    c.spelled = dict(own.spelled)
    if from_cwd:
        own.notes.append(f"{', '.join(from_cwd)}: not beside {os.path.basename(path)} but in the working directory, "
                         "read from there as LlamaFactory reads its paths (a path in a run.yaml is read from its "
                         "folder first)")
    for note in own.notes + their_keys.notes(c, own.keys):
        print(f"  note           {note}", flush=True)
    c.given = _given(c, {k: _overridden(k, v, base) if k in overridden else v for k, v in raw.items()}, base)
    return c


def _overridden(key: str, value: Any, base: str) -> Any:
    """An override's value with its paths absolute, as the run read them: from the working directory,
    a tools file from the run.yaml's folder (data/run_tools.py)."""
    own = aliases.own_key(key)
    return _relative(own, value, base if own in FILE_KEYS and isinstance(value, str) else os.getcwd())


def _given(c: RunConfig, raw: dict, folder: str) -> dict:
    """The settings as given, which the run folder's training_args.yaml holds (run_args.py): `raw`,
    the run.yaml's with the overrides laid over, PATH_KEYS absolute (the file's from its folder
    `folder`, the overrides' from the working directory), with what the run found elsewhere made
    absolute too: an adapter folder (read from the working directory, as LlamaFactory reads
    adapter_name_or_path) and, among reward_funcs, a reward model's folder (found as given, in the
    working directory or beside the run.yaml: grpo_keys.py) and the file of a reward function's (or
    a tool's) module found in the working directory or beside the run.yaml, as FILE.py:function
    (posttrain/rewards.py's `written`)."""
    out = {}
    for key, value in raw.items():
        own = aliases.own_key(key)
        if own == "adapter" and isinstance(value, str):
            value = os.path.abspath(value)
        elif own == "reward_funcs" and isinstance(c.reward_funcs, list):
            from ..posttrain import rewards
            value = [rewards.written(name, folder) for name in c.reward_funcs]     # each folder as found
        elif own == "tools" and isinstance(value, list):
            from ..posttrain import rewards
            value = [rewards.written(tool, folder) if isinstance(tool, str) else tool for tool in value]
        out[key] = value
    return out


def _from_scratch(c: RunConfig) -> None:
    """LlamaFactory's train_from_scratch: the model folder's config.json, randomly initialised (seeded
    by `seed`), its tokenizer the folder's: the same run as `model: FOLDER/config.json`."""
    c.train_from_scratch = flag("train_from_scratch", c.train_from_scratch)
    if not c.train_from_scratch:
        return
    if c.bundled:
        raise ArgumentError("train_from_scratch: the bundled model always starts from random weights; leave it out")
    if not os.path.isdir(c.model):
        raise ArgumentError(f"train_from_scratch: model {c.model} is a config file, which a run trains from scratch "
                            "already; leave train_from_scratch out")
    c.tokenizer = c.tokenizer or c.model
    c.model = os.path.join(c.model, "config.json")


def _override(item: str) -> tuple[str, Any]:
    import yaml
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ArgumentError(f"overrides are key=value (e.g. lr=2e-5 steps=500); got {item!r}")
    try:
        return key.strip(), yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        raise ArgumentError(f"override {item!r}: the value is not valid YAML: {e}") from e


PATH_KEYS = ("model", "tokenizer", "chat_template", "media_dir", "data", "eval", "run_dir", "export", "resume",
             "nvme_dir", "dump_dir", "dataset_dir")
FILE_KEYS = ("tools",)      # a path where the value is one string (a list names functions or describes them)
FUNCTION_KEYS = ("reward_funcs", "tools")     # functions named module:function, or FILE.py:function


def _relative(key: str, value: Any, base: str) -> Any:
    """Paths in a run.yaml are relative to the file's folder."""
    if key in FILE_KEYS and isinstance(value, str):
        return _relative(PATH_KEYS[0], value, base)
    if key in FUNCTION_KEYS:    # a FILE.py:function among module:function names (posttrain/rewards.py)
        return [_function(v, base) for v in value] if isinstance(value, list) else _function(value, base)
    if key not in PATH_KEYS or value in (None, BUNDLED, "auto"):
        return value
    if isinstance(value, list):
        return [_relative(key, v, base) for v in value]
    if isinstance(value, dict) and isinstance(value.get("path"), str):     # a data entry {path, weight}
        return {**value, "path": _relative(key, value["path"], base)}
    if isinstance(value, str) and not os.path.isabs(value):
        return os.path.join(base, value)
    return value


# What a run reads (not what it writes): a relative path not found beside the run.yaml is looked
# for in the working directory, where LlamaFactory reads its paths from (its examples are run from
# its repository's root: `dataset_dir: data`, `model_name_or_path: saves/...`).
READ_KEYS = ("model", "tokenizer", "chat_template", "media_dir", "data", "eval", "resume", "dataset_dir")


def _beside_or_here(key: str, written: Any, resolved: Any, found: list[str]) -> Any:
    """`resolved` (`written` made relative to the run.yaml's folder), unless it names nothing there
    while `written` names something in the working directory: then that, its key added to `found`."""
    if key not in READ_KEYS:
        return resolved
    if isinstance(written, list) and isinstance(resolved, list) and len(written) == len(resolved):
        return [_beside_or_here(key, w, r, found) for w, r in zip(written, resolved)]
    if isinstance(written, dict) and isinstance(resolved, dict) and "path" in written:
        return {**resolved, "path": _beside_or_here(key, written["path"], resolved["path"], found)}
    if (isinstance(written, str) and written != resolved and not os.path.isabs(written)
            and not os.path.exists(resolved) and os.path.exists(written)):
        if key not in found:
            found.append(key)
        return os.path.abspath(written)
    return resolved


def _function(value: Any, base: str) -> Any:
    file, sep, function = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    return f"{_relative(PATH_KEYS[0], file, base)}:{function}" if sep and file.endswith(".py") else value


def check(raw: dict, source: str = "the run config", model_only: bool = False) -> RunConfig:
    unknown = sorted(set(raw) - set(KEYS))
    told = their_keys.refusal(unknown)
    if told:        # TRL's or LlamaFactory's keys megacompile does not take: what to give instead, or why
        rest = [k for k in unknown if k not in their_keys.NOT_TAKEN]
        raise ArgumentError(f"{source}: {told}" + (f"; {_unknown(rest)}" if rest else ""))
    if unknown:
        raise ArgumentError(f"{source}: {_unknown(unknown)}")
    c = RunConfig(**{k: v for k, v in raw.items()})
    c.model = text("model", c.model)
    if not c.bundled:
        folder_or_file("model", c.model, "a Hugging Face model folder (config.json, safetensors, tokenizer files), "
                       "a config.json to train from scratch, or 'bundled'")
    _from_scratch(c)
    c.tokenizer = text("tokenizer", c.tokenizer, optional=True)
    if c.tokenizer is not None:
        if c.bundled:
            raise ArgumentError("tokenizer: the bundled model reads bytes and takes no tokenizer; leave it out")
        folder_or_file("tokenizer", c.tokenizer, "a folder with tokenizer.json / tokenizer_config.json")
    elif not c.bundled and not os.path.isdir(c.model):
        raise ArgumentError(f"tokenizer: model {c.model} is a config file, which holds no tokenizer; "
                            "name a tokenizer folder")
    c.eos_token = text("eos_token", c.eos_token, optional=True)
    eos_token.check(c)
    c.bundled_model = _bundled_model(c.bundled_model)
    check_data(c, raw, files=not model_only)
    if c.disable_dropout is None:
        c.disable_dropout = c.stage in DROPOUT_OFF
    c.disable_dropout = flag("disable_dropout", c.disable_dropout)
    c.disable_shuffling = flag("disable_shuffling", c.disable_shuffling)
    c.trim_padding = flag("trim_padding", c.trim_padding)
    c.seq = integer("seq", c.seq, 2)
    if c.packing is not None and (c.packing not in PACKING or isinstance(c.packing, int)
                                  and not isinstance(c.packing, bool)):
        raise ArgumentError(f"packing must be false, true or isolated; got {c.packing!r}")
    if c.packing == "isolated" and c.bundled:
        raise ArgumentError("packing: isolated needs a model that takes position_ids (a Hugging Face decoder); "
                            "the bundled model does not; use packing: true")
    if c.global_batch is not None:
        c.global_batch = integer("global_batch", c.global_batch)
        if raw.get("batch") is not None or raw.get("grad_accum") is not None:
            raise ArgumentError("global_batch lets the planner choose batch and grad_accum: give global_batch, "
                                "or batch and grad_accum, not both")
    c.batch = integer("batch", c.batch)
    c.lr = number("lr", c.lr, 0.0)
    if c.lr > MAX_LR:
        raise ArgumentError(f"lr {c.lr:g} is not a learning rate AdamW can train with: each step moves every weight "
                            f"by about lr, so lr is at most {MAX_LR:g} (fine-tuning takes 1e-6 to 1e-4, "
                            "pretraining up to about 1e-3)")
    c.warmup = warmup(c.warmup)
    if c.schedule not in SCHEDULES:
        raise ArgumentError(f"schedule must be one of {', '.join(SCHEDULES)}; got {c.schedule!r}")
    c.min_lr = number("min_lr", c.min_lr, 0.0)
    if c.min_lr > c.lr:
        raise ArgumentError(f"min_lr {c.min_lr:g} is above lr {c.lr:g}: the schedule decays from lr to min_lr")
    c.weight_decay = number("weight_decay", c.weight_decay, 0.0)
    if not isinstance(c.betas, (list, tuple)) or len(c.betas) != 2:
        raise ArgumentError(f"betas must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]; got {c.betas!r}")
    c.betas = [number("betas", b, 0.0, below=1.0) for b in c.betas]
    c.eps = number("eps", c.eps, 0.0, strict=True, below=1.0)
    if c.lr * c.weight_decay >= 1:
        raise ArgumentError(f"weight_decay {c.weight_decay:g} with lr {c.lr:g}: AdamW multiplies each weight by "
                            f"1 - lr * weight_decay = {1 - c.lr * c.weight_decay:g} a step, which erases or flips it; "
                            "give lr * weight_decay < 1 (weight_decay is usually 0 to 0.1)")
    c.max_grad_norm = None if c.max_grad_norm is None else number("max_grad_norm", c.max_grad_norm, 0.0, strict=True)
    c.budget_fraction = number("budget_fraction", c.budget_fraction, 0.0, strict=True)
    c.compute_dtype = choice("compute_dtype", c.compute_dtype, DTYPES)
    c.export_dtype = choice("export_dtype", c.export_dtype, DTYPES)
    c.device = None if c.device is None else choice("device", c.device, DEVICES)
    # compile()'s settings: YAML reads 2e-5 (no dot) and inf as strings, so budgets are numbers first.
    for key in ("hbm_budget", "host_budget", "nvme_budget"):
        setattr(c, key, numeric(getattr(c, key)))
    if c.updates == "as_gradients_land":    # compile()'s refusals, in run.yaml's words
        if c.max_grad_norm is not None:
            raise ArgumentError(f"updates: as_gradients_land cannot clip gradients (max_grad_norm {c.max_grad_norm:g}; "
                                "run.yaml clips at 1.0 unless told): the global norm is known only after the last "
                                "gradient lands; set max_grad_norm: null, or updates: at_commit")
        if c.global_batch is not None:
            raise ArgumentError("updates: as_gradients_land needs one micro-batch per step: give batch (and "
                                "grad_accum 1), not global_batch")
    c.settings().for_a_run()
    if (c.steps is None) == (c.epochs is None):
        raise ArgumentError("give steps (optimizer steps) or epochs (passes over the training data), one of them; "
                            f"got steps={c.steps!r}, epochs={c.epochs!r}")
    c.steps = None if c.steps is None else integer("steps", c.steps)
    c.epochs = None if c.epochs is None else number("epochs", c.epochs, 0.0, strict=True)
    for key in intervals.KEYS:
        value = getattr(c, key)
        if key == "log_every" or not (value is None or key == "save_every" and value is False):
            setattr(c, key, intervals.check(key, value))
    if c.steps is not None:     # with epochs, once the data gives the steps (loop.run)
        c.warmup = warmup_steps(c.warmup, c.steps)
        intervals.resolve(c)
    if c.streaming and intervals.EPOCH in (c.eval_every, c.save_every):
        raise ArgumentError("streaming does not know the data's size ahead, so the end of an epoch is not known: give "
                            "eval_every and save_every in steps, or streaming: false")
    # LlamaFactory's preprocessing_num_workers: null is one process; more than the cores buy nothing
    workers = 1 if c.tokenize_workers is None else c.tokenize_workers
    c.tokenize_workers = min(integer("tokenize_workers", workers), os.cpu_count() or 1)
    for key in ("eval_batches", "eval_batch", "keep_last", "max_consecutive_skips"):
        if getattr(c, key) is not None:
            setattr(c, key, integer(key, getattr(c, key)))
    if c.save_every is False and c.bundled:
        raise ArgumentError("save_every: false (save_strategy: no) writes no checkpoint, and the bundled model, "
                            "no Hugging Face model, has no other place for its trained weights: give save_every, "
                            "or leave it out (a checkpoint after the last step)")
    if c.eval_every is not None and not (c.eval or c.eval_fraction):
        raise ArgumentError("eval_every needs held-out data: give eval (files) or eval_fraction")
    c.stop_signals = preemption.signal_names(c.stop_signals)
    c.resume = text("resume", c.resume, optional=True)
    latest = os.path.basename(os.path.normpath(c.resume or "")) == "latest"    # RUN/checkpoints/latest (resume.py)
    if c.resume not in (None, "auto") and not model_only and not (
            os.path.isdir(c.resume) or latest and os.path.isdir(os.path.dirname(os.path.normpath(c.resume)))):
        raise ArgumentError(f"resume is 'auto' (the latest committed checkpoint in run_dir), a checkpoint folder, a "
                            f"run folder (its latest checkpoint), or null; {c.resume} is not a folder")
    c.run_dir = text("run_dir", c.run_dir, optional=True)
    if c.resume == "auto" and c.run_dir is None:
        raise ArgumentError("resume: auto looks for checkpoints in run_dir: name the run_dir of the run to resume")
    arguments.folder("run_dir", c.run_dir)
    c.name = text("name", c.name)
    if not c.name or os.sep in c.name:
        raise ArgumentError(f"name is the run's name (runs/NAME-TIME), one path component; got {c.name!r}")
    c.log = loggers(c.log)
    c.wandb_project = text("wandb_project", c.wandb_project, optional=True)
    c.export = text("export", c.export, optional=True)
    arguments.folder("export", c.export)
    if c.export is not None and c.bundled:
        raise ArgumentError("export writes a Hugging Face model folder, and the bundled model is not a Hugging Face "
                            "model; leave export out (its checkpoints hold the weights)")
    c.seed = integer("seed", c.seed, 0)
    for entry in c.data + c.eval:
        if entry["num_samples"]:
            entry["seed"] = c.seed      # which records num_samples draws (reading.py)
    check_media(c)
    from .methods import check as check_finetuning
    check_finetuning(c, raw, files=not model_only)
    from .stages.keys import check as check_stage
    folder = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else None
    check_stage(c, raw, folder, files=not model_only)
    router_loss.check(c)
    rope_scaling.check(c)
    vocab.check(c)
    best_model.check(c)
    early_stopping.check(c)
    c.eval_on_start = flag("eval_on_start", c.eval_on_start)
    if c.eval_on_start and not c.eval_every:
        raise ArgumentError("eval_on_start evaluates before the first step, as the evaluations every eval_every steps "
                            "do: give held-out data (eval or eval_fraction) and eval_every")
    c.plot_loss = flag("plot_loss", c.plot_loss)
    if c.plot_loss and importlib.util.find_spec("matplotlib") is None:
        raise ArgumentError("plot_loss: true draws training_loss.png with matplotlib, which is not installed: "
                            "pip install 'megacompile[plot]' (or pip install matplotlib), or set plot_loss: false")
    c.compute_accuracy = flag("compute_accuracy", c.compute_accuracy)
    if c.compute_accuracy and (c.stage != "sft" or c.bundled or c.loss_type in ("dft", "eaft")
                               or not (c.eval or c.eval_fraction)):
        raise ArgumentError("compute_accuracy is LlamaFactory's held-out token accuracy of a Hugging Face model under "
                            "stage sft (its cross-entropy loss): it needs held-out data (eval or eval_fraction) and "
                            f"the model's logits; here stage {c.stage}"
                            + (", the bundled model" if c.bundled else "")
                            + (f", loss_type {c.loss_type}" if c.loss_type in ("dft", "eaft")
                                                                              else ""))
    c.eval_on_each_dataset = flag("eval_on_each_dataset", c.eval_on_each_dataset)
    if c.eval_on_each_dataset and (c.stage not in ("sft", "pt") or not c.eval):
        raise ArgumentError("eval_on_each_dataset evaluates each held-out file (eval, or eval_dataset's names) on its "
                            "own, as LlamaFactory does, under stages sft and pt: "
                            + (f"stage {c.stage} evaluates its own figures" if c.stage not in ("sft", "pt") else
                               "give the held-out data as files (eval_fraction's rows are one set)"))
    neftune.check(c)
    if c.stage == "pt":     # LlamaFactory's pretraining: every record read as its text (data/pretrain.py)
        for entry in c.data + c.eval:
            entry["pretrain"] = True
    lay_tools(c, folder, files=not model_only)
    return c


def _unknown(keys: list[str]) -> str:
    """Unknown keys, each with the known name it is closest to (a typo's fix), if any is close."""
    import difflib
    names = [*KEYS, *aliases.ALIASES, *aliases.SPECIAL, *aliases.IGNORED, *their_keys.NOT_TAKEN]
    told = []
    for key in keys:
        close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.75)
        told.append(f"{key} (did you mean {close[0]}?)" if close else str(key))
    return (f"unknown key{'s' if len(keys) > 1 else ''} {', '.join(told)}; docs/training.md lists the keys, "
            "megacompile's and the LlamaFactory and transformers/TRL names read as them")


def _bundled_model(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ArgumentError(f"bundled_model is a mapping of {', '.join(BUNDLED_MODEL)}; got {value!r}")
    unknown = sorted(set(value) - set(BUNDLED_MODEL))
    if unknown:
        raise ArgumentError(f"bundled_model: unknown key {', '.join(unknown)}; the keys are {', '.join(BUNDLED_MODEL)}")
    merged = {**BUNDLED_MODEL, **value}
    for k, v in merged.items():
        integer(f"bundled_model.{k}", v)
    if merged["dim"] % merged["heads"] or (merged["dim"] // merged["heads"]) % 2:
        raise ArgumentError(f"bundled_model: heads {merged['heads']} must split dim {merged['dim']} into an even "
                            "head size (rotary embeddings)")
    if merged["heads"] % merged["kv_heads"]:
        raise ArgumentError(f"bundled_model: kv_heads {merged['kv_heads']} must divide heads {merged['heads']}")
    return merged
