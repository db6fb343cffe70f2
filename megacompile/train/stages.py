"""`stage: sft | dpo | grpo`: run.yaml's post-training keys (TRL's names), each checked, and each
refused under a stage it does not belong to, before anything is read or written.

    dpo    beta (0.1), label_smoothing (0), loss_type (sigmoid | ipo)
    grpo   beta (0: no KL term), loss_type (dapo | grpo | bnpo | dr_grpo), num_generations (8),
           max_prompt_length (512), max_completion_length (256), temperature (1.0), epsilon (0.2),
           epsilon_high (epsilon), reward_funcs, reward_weights (1 each), num_iterations (1), and the
           generator's keys (rollout_generator.py)
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import ArgumentError
from ..posttrain import dpo, grpo
from . import rollout_generator

STAGES = ("sft", "dpo", "grpo")
REFUSED = ("pt", "rm", "ppo", "kto")
KEYS = {"dpo": ("beta", "label_smoothing", "loss_type"),
        "grpo": ("beta", "loss_type", "num_generations", "max_prompt_length", "max_completion_length", "temperature",
                 "epsilon", "epsilon_high", "reward_funcs", "reward_weights", "num_iterations")
        + rollout_generator.KEYS}
ALL_KEYS = tuple(dict.fromkeys(KEYS["dpo"] + KEYS["grpo"]))
DEFAULTS = {"dpo": {"beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid"},
            "grpo": {"beta": 0.0, "loss_type": "dapo", "num_generations": 8, "max_prompt_length": 512,
                     "max_completion_length": 256, "temperature": 1.0, "epsilon": 0.2, "epsilon_high": None,
                     "reward_weights": None, "num_iterations": 1}}
# SFT keys whose meaning a post-training stage does not have (yet): refused rather than ignored.
NOT_FOR = {"dpo": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                   "dataset", "eval_dataset"),
           "grpo": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                    "dataset", "eval_dataset", "seq")}


def check(c, raw: dict) -> None:
    """c.stage and its keys, in place; `raw`: the keys the run.yaml gave (defaults are not given)."""
    if c.stage in REFUSED:
        raise ArgumentError(f"stage {c.stage!r} is not supported; megacompile train runs stage: sft (the default), "
                            "dpo or grpo")
    if c.stage not in STAGES:
        raise ArgumentError(f"stage must be one of {', '.join(STAGES)}; got {c.stage!r}")
    given = [k for k in ALL_KEYS if raw.get(k) is not None]
    foreign = [k for k in given if k not in KEYS.get(c.stage, ())]
    if foreign:
        owners = {k: " or ".join(s for s in KEYS if k in KEYS[s]) for k in foreign}
        raise ArgumentError(f"stage {c.stage}: {', '.join(f'{k} (stage {owners[k]})' for k in foreign)} "
                            f"belong{'s' if len(foreign) == 1 else ''} to another stage; set stage to it, or leave "
                            f"{'it' if len(foreign) == 1 else 'them'} out")
    if c.stage == "sft":
        return
    wrong = [k for k in NOT_FOR[c.stage] if k in raw and raw[k] is not None]
    if wrong:
        raise ArgumentError(f"stage {c.stage}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not taken by "
                            f"{c.stage} (docs/posttraining.md lists its keys); leave "
                            f"{'it' if len(wrong) == 1 else 'them'} out")
    if c.finetuning_type == "lora" and c.lora_dropout not in (None, 0):
        # The reference, the old-policy and the metrics passes run the policy forward in training
        # mode: dropout there would make each a random draw, not the policy's log-probabilities.
        raise ArgumentError(f"stage {c.stage} with finetuning_type lora takes lora_dropout 0 (the reference and "
                            f"old-policy log-probabilities are forward passes that dropout would randomise, as TRL "
                            f"disables it); got lora_dropout {c.lora_dropout!r}")
    if c.bundled:
        raise ArgumentError(f"stage {c.stage} needs a Hugging Face model folder and its tokenizer (model: FOLDER); "
                            "the bundled model reads bytes and has no end-of-sequence token")
    for entry in c.data + c.eval:
        if entry.get("kind") != "jsonl":
            raise ArgumentError(f"stage {c.stage} reads .jsonl records ({_records(c.stage)}); {entry['path']} is not "
                                "a .jsonl file")
    for key, default in DEFAULTS[c.stage].items():
        if getattr(c, key) is None:
            setattr(c, key, default)
    _dpo(c) if c.stage == "dpo" else _grpo(c, raw)


def _records(stage: str) -> str:
    return "{prompt, chosen, rejected}" if stage == "dpo" else "a prompt and the columns the rewards read"


def _dpo(c) -> None:
    c.beta = _positive("beta", c.beta)
    c.label_smoothing = _number("label_smoothing", c.label_smoothing)
    if not 0.0 <= c.label_smoothing < 0.5:
        raise ArgumentError(f"label_smoothing must be in [0, 0.5) (0: plain DPO); got {c.label_smoothing!r}")
    _loss_type(c, dpo.LOSS_TYPES)
    if c.loss_type == "ipo" and c.label_smoothing:
        raise ArgumentError("label_smoothing applies to loss_type sigmoid; ipo takes none: leave it out")


def _grpo(c, raw: dict) -> None:
    c.beta = _number("beta", c.beta)
    if c.beta < 0:
        raise ArgumentError(f"beta must be >= 0 (0 turns the KL term off, as TRL's default); got {c.beta!r}")
    _loss_type(c, grpo.LOSS_TYPES)
    for key, least in (("num_generations", 2), ("max_prompt_length", 1), ("max_completion_length", 1),
                       ("num_iterations", 1)):
        value = getattr(c, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ArgumentError(f"{key} must be a whole number >= {least}; got {value!r}"
                                + ("; a group of one completion has no advantage" if key == "num_generations" else ""))
    c.temperature = _number("temperature", c.temperature)
    if c.temperature < 0:
        raise ArgumentError(f"temperature must be >= 0 (0: greedy; 1.0: the policy's own distribution); got "
                            f"{c.temperature!r}")
    c.epsilon = _number("epsilon", c.epsilon)
    if not 0 < c.epsilon < 1:
        raise ArgumentError(f"epsilon must be in (0, 1), e.g. 0.2; got {c.epsilon!r}")
    if c.epsilon_high is not None and _number("epsilon_high", c.epsilon_high) <= 0:
        raise ArgumentError(f"epsilon_high must be positive (DAPO uses 0.28); got {c.epsilon_high!r}")
    funcs = [c.reward_funcs] if isinstance(c.reward_funcs, str) else c.reward_funcs
    if not isinstance(funcs, list) or not funcs or not all(isinstance(f, str) and f for f in funcs):
        raise ArgumentError(f"reward_funcs is a list of reward functions, each module:function or a built-in "
                            f"(exact_answer, format_check); got {c.reward_funcs!r}")
    from ..posttrain.rewards import load
    for name in funcs:
        load(name)      # importable now: a missing module is refused before the model is read
    c.reward_funcs = funcs
    if c.reward_weights is not None:
        weights = c.reward_weights
        if not isinstance(weights, list) or len(weights) != len(funcs):
            raise ArgumentError(f"reward_weights is a list of one number per reward function ({len(funcs)}); got "
                                f"{weights!r}")
        c.reward_weights = [_number("reward_weights", w) for w in weights]
    if c.batch % c.num_generations:
        raise ArgumentError(f"batch {c.batch} (completions per rollout batch, TRL's per_device_train_batch_size) "
                            f"must be a multiple of num_generations {c.num_generations}; give batch "
                            f"{c.num_generations * max(1, c.batch // c.num_generations)}")
    if c.grad_accum != 1:
        raise ArgumentError(f"stage grpo trains each rollout batch as one micro-batch: grad_accum must be 1; got "
                            f"{c.grad_accum!r} (raise batch instead)")
    for key in ("steps", "save_every"):
        value = getattr(c, key)
        if value is not None and value % c.num_iterations:
            raise ArgumentError(f"{key} {value} must be a multiple of num_iterations {c.num_iterations} (each rollout "
                                f"batch trains num_iterations steps, and a checkpoint falls between rollout batches)")
    c.seq = c.max_prompt_length + c.max_completion_length
    rollout_generator.check(c, raw)


def _loss_type(c, allowed: tuple) -> None:
    if c.loss_type not in allowed:
        raise ArgumentError(f"loss_type for stage {c.stage} must be one of {', '.join(allowed)}; got {c.loss_type!r}")


def _number(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)        # YAML reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ArgumentError(f"{key} must be a number; got {value!r}")
    return float(value)


def _positive(key: str, value: Any) -> float:
    number = _number(key, value)
    if number <= 0:
        raise ArgumentError(f"{key} must be a positive number, e.g. 0.1; got {value!r}")
    return number
