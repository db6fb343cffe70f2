"""`stage: sft | pt | dpo | kto | grpo`: run.yaml's post-training keys (TRL's names), each checked, and each
refused under a stage it does not belong to, before anything is read or written.

    dpo    beta (0.1), label_smoothing (0), loss_type (sigmoid, or any of posttrain/dpo_losses.py's,
           or a list of them), loss_weights (1 each), rpo_alpha (none: the sft term's weight),
           pref_ftx (none: LlamaFactory's weight of each pair's chosen NLL, posttrain/dpo.py),
           discopop_tau (0.05), simpo_gamma (0.5), f_divergence_type (reverse_kl) and
           f_alpha_divergence_coef (0.5), use_weighting (false: WPO's pair weights), ld_alpha
           (none: LD-DPO's weight of the tokens past the shorter completion), sync_ref_model (false;
           true: TR-DPO's reference updates, ref_model_mixup_alpha 0.6, ref_model_sync_steps 512),
           precompute_ref_log_probs (accepted either way:
           the reference's log-probabilities are computed once, before the first step, where a loss
           type reads them), max_prompt_length and max_completion_length (none), truncation_mode
           (keep_start): how a pair fits rows of seq, checked in truncation.py
    kto    beta (0.1), loss_type (kto | apo_zero_unpaired), desirable_weight (1.0),
           undesirable_weight (1.0), pref_ftx (none: LlamaFactory's), precompute_ref_log_probs
           (accepted either way, as under dpo: the reference's are computed once a run),
           max_prompt_length (none) and truncation_mode (keep_start; keep_end where
           max_prompt_length is given alone), KTOConfig's meanings, not DPOConfig's: checked in
           example_cuts.py; batch at least 2 for kto (its KL rows)
    grpo   beta (0: no KL term), loss_type (dapo | grpo | bnpo | dr_grpo | cispo | sapo | luspo | vespo),
           sapo_temperature_pos (1.0) and _neg (1.05), vespo_k_pos (2.0), _lambda_pos (3.0), _k_neg
           (3.0), _lambda_neg (2.0), entropy_coef (0: TRL's entropy bonus off), off_policy_mask_threshold
           (none: DeepSeek-V3.2's off-policy sequence mask off), log_completions (false)
           and num_completions_to_print (all: completions_log.py), num_generations (8),
           num_generations_eval (none: one greedy completion of each held-out prompt; n: n sampled
           ones, as TRL evaluates),
           max_prompt_length (512), max_completion_length (256), temperature (1.0), the sampling
           filters top_k (0: off), top_p (1.0), min_p (none) and repetition_penalty (1.0: off,
           posttrain/sampling_filters.py), epsilon (0.2),
           epsilon_high (epsilon), delta (none), reward_funcs, reward_weights (1 each),
           scale_rewards (group), multi_objective_aggregation (sum_then_normalize | normalize_then_sum:
           GDPO), mask_truncated_completions (false), importance_sampling_level
           (token), top_entropy_quantile (1.0), num_iterations (1), steps_per_generation
           (grad_accum) or generation_batch_size (batch x steps_per_generation),
           use_bias_correction_kl (true, TRL's: the KL term weighed by the importance weight),
           sync_ref_model (false; true: TR-DPO's reference updates, with beta > 0,
           ref_model_mixup_alpha 0.6 and ref_model_sync_steps 512: posttrain/reference_sync.py), and
           the generator's keys (rollouts.py); checked in grpo_keys.py
"""
from __future__ import annotations


from ...errors import ArgumentError
from ...posttrain import DPOLoss, dpo_losses, kto
from ..data import feedback
from ..methods import adapters
from . import example_cuts, grpo_keys, rollouts, truncation
from .checks import note, number, positive, reference_updates

STAGES = ("sft", "pt", "dpo", "kto", "rm", "grpo")
REFUSED = ("ppo",)
# TRL's preference keys of a row's length, read by stages/truncation.py (kto: example_cuts.py)
CUTS = ("max_prompt_length", "max_completion_length", "truncation_mode")
KEYS = {"dpo": ("beta", "label_smoothing", "loss_type", "loss_weights", "precompute_ref_log_probs", "rpo_alpha",
                "discopop_tau", "simpo_gamma", "pref_ftx", "f_divergence_type", "f_alpha_divergence_coef",
                "use_weighting", "ld_alpha", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps") + CUTS,
        "kto": ("beta", "loss_type", "desirable_weight", "undesirable_weight", "pref_ftx", "precompute_ref_log_probs")
        + CUTS,
        "rm": ("center_rewards_coefficient",),
        "grpo": ("beta", "loss_type", "num_generations", "num_generations_eval", "max_prompt_length", "max_completion_length", "temperature",
                 "top_k", "top_p", "min_p", "repetition_penalty", "generation_kwargs", "epsilon", "sapo_temperature_pos",
                 "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                 "entropy_coef", "log_completions", "num_completions_to_print", "multi_objective_aggregation",
                 "off_policy_mask_threshold", "epsilon_high", "delta", "reward_funcs", "reward_weights", "scale_rewards",
                 "mask_truncated_completions", "importance_sampling_level", "top_entropy_quantile", "num_iterations",
                 "steps_per_generation", "generation_batch_size", "use_bias_correction_kl", "sync_ref_model",
                 "ref_model_mixup_alpha", "ref_model_sync_steps")
        + rollouts.KEYS}
ALL_KEYS = tuple(dict.fromkeys(KEYS["dpo"] + KEYS["kto"] + KEYS["rm"] + KEYS["grpo"]))
DEFAULTS = {"dpo": {"beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid", "loss_weights": None,
                    "precompute_ref_log_probs": False, "rpo_alpha": None, "discopop_tau": 0.05, "simpo_gamma": 0.5,
                    "pref_ftx": None, "f_divergence_type": "reverse_kl", "f_alpha_divergence_coef": 0.5,
                    "use_weighting": False, "ld_alpha": None, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
                    "ref_model_sync_steps": 512, **{k: None for k in CUTS}, "truncation_mode": "keep_start"},
            "kto": {"beta": 0.1, "loss_type": "kto", "desirable_weight": 1.0, "undesirable_weight": 1.0,
                    "pref_ftx": None, "precompute_ref_log_probs": False, **{k: None for k in CUTS},
                    "truncation_mode": "keep_start"},
            "rm": {"center_rewards_coefficient": 0.0},
            "grpo": {"beta": 0.0, "loss_type": "dapo", "num_generations": 8, "num_generations_eval": None,
                     "max_prompt_length": 512,
                     "max_completion_length": 256, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": None,
                     "repetition_penalty": 1.0, "generation_kwargs": None, "epsilon": 0.2, "epsilon_high": None, "sapo_temperature_pos": 1.0,
                     "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0,
                     "vespo_lambda_neg": 2.0, "entropy_coef": 0.0, "log_completions": False,
                     "num_completions_to_print": None, "multi_objective_aggregation": "sum_then_normalize",
                     "off_policy_mask_threshold": None,
                     "delta": None, "reward_weights": None, "scale_rewards": "group",
                     "mask_truncated_completions": False, "importance_sampling_level": "token",
                     "top_entropy_quantile": 1.0, "num_iterations": 1, "steps_per_generation": None,
                     "generation_batch_size": None, "use_bias_correction_kl": True, "sync_ref_model": False,
                     "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512}}
# What a checkpoint saved before these keys existed trained with (their defaults, then as now).
IMPLIED = ({k: v for stage in DEFAULTS.values() for k, v in stage.items()
           if k in ("loss_weights", "precompute_ref_log_probs", "rpo_alpha", "discopop_tau", "simpo_gamma", "pref_ftx",
                    "f_divergence_type", "f_alpha_divergence_coef", "use_weighting", "ld_alpha",
                    "delta",
                    "scale_rewards",
                    "mask_truncated_completions", "importance_sampling_level", "top_entropy_quantile",
                    "generation_batch_size", "top_k", "top_p", "min_p", "repetition_penalty",
                    "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
                    "vespo_k_neg", "vespo_lambda_neg", "entropy_coef", "multi_objective_aggregation",
                    "off_policy_mask_threshold", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
                    "truncation_mode")}
           | {"steps_per_generation": 1, "use_bias_correction_kl": False})
# Their LlamaFactory defaults, which its dumps write under every stage: there they ask for nothing.
LLAMAFACTORY_OFF = {"streaming": False, "train_on_prompt": False, "mix_strategy": "concat", "mask_history": False}
# SFT keys whose meaning a post-training stage does not have (yet): refused rather than ignored.
_SFT_LOSS = ("assistant_only_loss", "completion_only_loss")     # TRL's SFTConfig's
NOT_FOR = {"dpo": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                   "dataset_text_field", "mask_history", *_SFT_LOSS),
           "kto": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                   "dataset_text_field", "mask_history", *_SFT_LOSS),
           "rm": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                  "dataset_text_field", "mask_history", *_SFT_LOSS),
           "grpo": ("global_batch", "streaming", "packing", "train_on_prompt", "mix_strategy", "interleave_probs",
                    "seq", "dataset_text_field", "mask_history", *_SFT_LOSS)}


def check(c, raw: dict, folder: str | None = None, files: bool = True) -> None:
    """c.stage and its keys, in place; `raw`: the keys the run.yaml gave (defaults are not given);
    `folder`: the run.yaml's, where reward modules are looked for too (posttrain/rewards.py); files
    False: those modules not imported (a run read for its model alone)."""
    if c.stage in REFUSED:
        raise ArgumentError(f"stage {c.stage!r} is not supported; megacompile train runs stage: sft (the default), "
                            "pt, dpo, kto, rm or grpo")
    if c.stage not in STAGES:
        raise ArgumentError(f"stage must be one of {', '.join(STAGES)}; got {c.stage!r}")
    if c.stage == "sft" and raw.get("loss_type") is not None:
        _sft_loss(c)
    if c.stage == "pt" and raw.get("loss_type") is not None:
        raise ArgumentError(f"stage pt trains the cross-entropy of every token of the text; loss_type "
                            f"{raw['loss_type']!r} is not taken there (stage sft takes nll, dft or eaft): leave it "
                            "out, or set stage: sft")
    _eaft_alpha(c, raw)
    _reference_updates_elsewhere(c, raw)
    _truncation_elsewhere(c, raw)
    given = [k for k in ALL_KEYS if raw.get(k) is not None and not (c.stage == "sft" and k == "loss_type")
             and not (k == "truncation_mode" and c.truncation_mode is None)
             and not (c.stage not in ("grpo", "dpo") and k in SYNC and raw[k] == DEFAULTS["grpo"][k])]
    foreign = [k for k in given if k not in KEYS.get(c.stage, ())]
    if foreign:
        owners = {k: " or ".join(s for s in KEYS if k in KEYS[s]) for k in foreign}
        raise ArgumentError(f"stage {c.stage}: {', '.join(f'{k} (stage {owners[k]})' for k in foreign)} "
                            f"belong{'s' if len(foreign) == 1 else ''} to another stage; set stage to it, or leave "
                            f"{'it' if len(foreign) == 1 else 'them'} out")
    if c.stage in ("sft", "pt"):
        return
    if c.loss_type in ("dft", "eaft"):
        raise ArgumentError(f"loss_type {c.loss_type} (use_{c.loss_type}_loss) is stage sft's, a weighted supervised "
                            f"loss; stage {c.stage} takes its own loss types (docs/posttraining.md): leave it out, or "
                            "set stage: sft")
    off = {k: v for k, v in LLAMAFACTORY_OFF.items() if type(raw.get(k)) is type(v) and raw[k] == v}
    wrong = [k for k in NOT_FOR[c.stage] if k in raw and raw[k] is not None and k not in off]
    if wrong:
        raise ArgumentError(f"stage {c.stage}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not taken by "
                            f"{c.stage} (docs/posttraining.md lists its keys); leave "
                            f"{'it' if len(wrong) == 1 else 'them'} out")
    if adapters(c) and c.lora_dropout not in (None, 0) and c.disable_dropout is not True:
        # The reference, the old-policy and the metrics passes run the policy forward in training
        # mode: dropout there would make each a random draw, not the policy's log-probabilities.
        raise ArgumentError(f"stage {c.stage} with finetuning_type lora takes lora_dropout 0 (the reference and "
                            f"old-policy log-probabilities are forward passes that dropout would randomise, as TRL "
                            f"disables it); got lora_dropout {c.lora_dropout!r}: set it to 0, or disable_dropout: "
                            "true (TRL's default), which sets it to 0")
    if c.bundled:
        raise ArgumentError(f"stage {c.stage} needs a Hugging Face model folder and its tokenizer (model: FOLDER); "
                            "the bundled model reads bytes and has no end-of-sequence token")
    for entry in c.data + c.eval:
        if entry.get("kind") == "text":
            raise ArgumentError(f"stage {c.stage} reads records ({_records(c.stage)}) from .jsonl, .json, .parquet, "
                                f".arrow or .csv files; {entry['path']} is text (one document), not records")
    for key, default in DEFAULTS[c.stage].items():
        if getattr(c, key) is None:
            setattr(c, key, default)
    if c.stage == "rm":
        _rm(c)
    else:
        _dpo(c) if c.stage == "dpo" else _kto(c, raw) if c.stage == "kto" else grpo_keys.check(c, raw, folder, files)


SYNC = ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")


def _reference_updates_elsewhere(c, raw: dict) -> None:
    """TRL's configs write sync_ref_model (false) and its two numbers: at those defaults they ask
    for nothing under any stage; sync_ref_model true is stage dpo's and grpo's alone here."""
    if c.stage not in ("grpo", "dpo") and raw.get("sync_ref_model") is True:
        raise ArgumentError(f"sync_ref_model (TR-DPO's reference updates) is not supported under stage {c.stage}: "
                            f"the reference's log-probabilities are computed once, before the first step, from the "
                            f"policy at step 0; stage dpo and grpo (with beta > 0) take it")


def _truncation_elsewhere(c, raw: dict) -> None:
    """truncation_mode: keep_start, TRL's default, which its SFTConfig dumps write too, asks
    for nothing under the other stages (a supervised record keeps its start, data/cutoff.py); keep_end
    is stage dpo's and kto's alone."""
    if c.stage in ("dpo", "kto") or raw.get("truncation_mode") is None:
        return
    if raw["truncation_mode"] != "keep_start":
        raise ArgumentError(f"truncation_mode {raw['truncation_mode']!r} is not supported under stage {c.stage}: a "
                            "record longer than seq keeps its start (keep_start, as LlamaFactory's cutoff_len cuts "
                            "it); stage dpo and kto take keep_end; leave truncation_mode out")
    c.truncation_mode = None


def _sft_loss(c) -> None:
    """TRL's SFTConfig.loss_type: `nll` (its default, what SFTConfig.to_dict() writes) is the
    cross-entropy; `dft` (LlamaFactory's use_dft_loss) weights each token's by its probability
    (posttrain/dft.py), `eaft` (LlamaFactory's use_eaft_loss) by the model's entropy there
    (posttrain/eaft.py). Left as "dft" or "eaft", or None for the cross-entropy."""
    if c.loss_type not in ("nll", "dft", "eaft"):
        raise ArgumentError(f"stage sft: loss_type is nll (TRL's SFT default, the cross-entropy), dft (dynamic "
                            f"fine-tuning, each token's cross-entropy weighted by its probability) or eaft "
                            f"(entropy-adaptive, weighted by the model's entropy there); got {c.loss_type!r}; DPO's "
                            "and GRPO's loss types belong to stage dpo and grpo")
    c.loss_type = None if c.loss_type == "nll" else c.loss_type


EAFT_ALPHA = 1.0        # LlamaFactory's default eaft_alpha


def _eaft_alpha(c, raw: dict) -> None:
    """eaft_alpha, the power on EAFT's entropy weight: a number >= 0 (0: the plain cross-entropy),
    EAFT_ALPHA by default; refused without loss_type eaft, but at its default (LlamaFactory writes it
    into every saved config)."""
    if c.loss_type != "eaft":
        if raw.get("eaft_alpha") is not None and raw["eaft_alpha"] != EAFT_ALPHA:
            raise ArgumentError(f"eaft_alpha {raw['eaft_alpha']!r} weights the EAFT loss, which this run does not "
                                "train: give use_eaft_loss: true (loss_type: eaft, stage sft), or leave eaft_alpha out")
        c.eaft_alpha = None
        return
    alpha = number("eaft_alpha", EAFT_ALPHA if c.eaft_alpha is None else c.eaft_alpha)
    if alpha < 0:
        raise ArgumentError(f"eaft_alpha must be a number >= 0 (the power on the entropy weight; 0 is the plain "
                            f"cross-entropy); got {c.eaft_alpha!r}")
    c.eaft_alpha = alpha


def _records(stage: str) -> str:
    return ("{prompt, chosen, rejected}, or LlamaFactory's ranking layouts" if stage in ("dpo", "rm")
            else "{prompt, completion, label}, or LlamaFactory's kto_tag datasets" if stage == "kto"
            else "a prompt and the columns the rewards read, or LlamaFactory's alpaca or sharegpt layouts")


def _rm(c) -> None:
    c.center_rewards_coefficient = number("center_rewards_coefficient", c.center_rewards_coefficient)
    if c.center_rewards_coefficient < 0:
        raise ArgumentError(f"center_rewards_coefficient weighs (r+ + r-)^2, pulling the rewards toward 0; it is >= 0 "
                            f"(TRL suggests 0.01); got {c.center_rewards_coefficient!r}")
    if adapters(c) and isinstance(c.lora_target, list) and "lm_head" in c.lora_target:
        raise ArgumentError("lora_target lm_head: a reward model scores with a new head in place of the causal LM's "
                            "lm_head, which it does not hold; leave lm_head out of lora_target")


def _pref_ftx(c) -> None:
    if c.pref_ftx is not None:
        c.pref_ftx = number("pref_ftx", c.pref_ftx)
        if c.pref_ftx < 0:
            raise ArgumentError(f"pref_ftx must be >= 0 (the weight of the chosen completions' NLL, LlamaFactory's; "
                                f"0 leaves it out); got {c.pref_ftx!r}")


def _kto(c, raw: dict) -> None:
    c.beta = positive("beta", c.beta)
    _pref_ftx(c)
    truncation.check(c)
    example_cuts.check(c, raw.get("truncation_mode") is not None)
    if not isinstance(c.precompute_ref_log_probs, bool):
        raise ArgumentError(f"precompute_ref_log_probs must be true or false; got {c.precompute_ref_log_probs!r}")
    if c.loss_type not in kto.LOSS_TYPES:
        raise ArgumentError(f"stage kto: loss_type must be one of {', '.join(kto.LOSS_TYPES)}; got {c.loss_type!r}")
    c.desirable_weight = positive("desirable_weight", c.desirable_weight)
    c.undesirable_weight = positive("undesirable_weight", c.undesirable_weight)
    if c.loss_type == "kto" and c.batch < 2 and not feedback.llamafactory_pairing(c.data):
        # TRL's pairing: each prompt with another example's completion of the same micro-batch
        raise ArgumentError("stage kto: batch (per_device_train_batch_size) must be at least 2: KTO's KL estimate "
                            "scores each prompt with another completion of its micro-batch (TRL's pairing, of records "
                            "{prompt, completion, label}), and a micro-batch of one has none (it would be the "
                            "completion's own reward); raise batch, take loss_type apo_zero_unpaired, which has no KL "
                            "term, or give the data as a LlamaFactory kto_tag dataset (dataset_info.json), whose KL "
                            "rows are paired across 1,000 examples")


def _dpo(c) -> None:
    c.beta = positive("beta", c.beta)
    truncation.check(c)
    kinds = dpo_losses.loss_types(c.loss_type)
    c.loss_type = kinds[0] if len(kinds) == 1 else list(kinds)
    c.label_smoothing = number("label_smoothing", c.label_smoothing)
    if "exo_pair" in kinds:
        if not 0.0 < c.label_smoothing < 1.0:
            raise ArgumentError(f"label_smoothing is exo_pair's epsilon and must be in (0, 1) (EXO recommends 1e-3); "
                                f"got {c.label_smoothing!r}")
    elif not 0.0 <= c.label_smoothing < 0.5:
        raise ArgumentError(f"label_smoothing must be in [0, 0.5) (0: plain DPO); got {c.label_smoothing!r}")
    if c.label_smoothing and not any(k in dpo_losses.READS_LABEL_SMOOTHING for k in kinds):
        note(f"label_smoothing {c.label_smoothing:g} is not read by loss_type {', '.join(kinds)}: as in TRL, only "
              f"{', '.join(dpo_losses.READS_LABEL_SMOOTHING)} read it")
    if c.loss_weights is not None:
        if not isinstance(c.loss_weights, list) or len(c.loss_weights) != len(kinds):
            raise ArgumentError(f"loss_weights is a list of one number per loss type ({len(kinds)}: "
                                f"{', '.join(kinds)}); got {c.loss_weights!r}")
        c.loss_weights = [number("loss_weights", w) for w in c.loss_weights]
    if c.rpo_alpha is not None:
        c.rpo_alpha = number("rpo_alpha", c.rpo_alpha)
        if c.rpo_alpha < 0:
            raise ArgumentError(f"rpo_alpha must be >= 0 (the weight of the chosen completions' NLL, RPO uses 1.0); "
                                f"got {c.rpo_alpha!r}")
        if "sft" in kinds:
            raise ArgumentError("rpo_alpha adds loss_type sft with that weight, and loss_type already holds sft: "
                                "give its weight in loss_weights and leave rpo_alpha out")
    _pref_ftx(c)
    c.discopop_tau = positive("discopop_tau", c.discopop_tau)
    c.f_alpha_divergence_coef = number("f_alpha_divergence_coef", c.f_alpha_divergence_coef)
    if not isinstance(c.use_weighting, bool):
        raise ArgumentError(f"use_weighting must be true or false; got {c.use_weighting!r}")
    if c.ld_alpha is not None:
        c.ld_alpha = number("ld_alpha", c.ld_alpha)
    c.simpo_gamma = number("simpo_gamma", c.simpo_gamma)
    if c.simpo_gamma < 0:
        raise ArgumentError(f"simpo_gamma is SimPO's target reward margin, >= 0 (0.5 by default); got {c.simpo_gamma!r}")
    # the loss's own checks of how the keys combine (f-DPO's loss types, WPO with aot, LD-DPO with the
    # plain-NLL terms), before anything is read: the stage builds the same loss from them
    kinds, weights = dpo_loss_terms(c)
    DPOLoss(c.beta, c.label_smoothing, kinds, weights, c.discopop_tau, c.simpo_gamma, c.pref_ftx or 0.0,
            c.f_divergence_type, c.f_alpha_divergence_coef, c.use_weighting, c.ld_alpha)
    if not isinstance(c.precompute_ref_log_probs, bool):
        raise ArgumentError(f"precompute_ref_log_probs must be true or false; got {c.precompute_ref_log_probs!r}")
    reads = any(k not in dpo_losses.REFERENCE_FREE for k in kinds)
    reference_updates(c, f"loss_type {', '.join(kinds)} reads no reference" if not reads else
                      "precompute_ref_log_probs true computes the reference's log-probabilities once (TRL refuses "
                      "the two together); set it to false" if c.precompute_ref_log_probs else None)


def dpo_loss_terms(c) -> tuple[tuple[str, ...], list[float] | None]:
    """The loss types a checked dpo run sums and their weights: loss_type with loss_weights, and
    rpo_alpha as TRL reads it, an `sft` term of that weight."""
    kinds = dpo_losses.loss_types(c.loss_type)
    weights = list(c.loss_weights) if c.loss_weights is not None else None
    if c.rpo_alpha is not None:
        weights = (weights or [1.0] * len(kinds)) + [c.rpo_alpha]
        kinds = kinds + ("sft",)
    return kinds, weights


# what a resumed run may change: where vLLM is reached, and what is written of the rollouts and
# evaluated (what the run logs, not what it trains)
MAY_CHANGE = rollouts.MAY_CHANGE + ("log_completions", "num_completions_to_print", "num_generations_eval")


def saved_keys(c) -> dict:
    """The post-training keys a resume keeps (a checkpoint of another stage or other keys is refused)."""
    return {"stage": c.stage, **{k: getattr(c, k) for k in ALL_KEYS if k not in MAY_CHANGE},
            **({"eaft_alpha": c.eaft_alpha} if c.loss_type == "eaft" else {})}


def check_resume(c, saved) -> None:
    before, now = saved.extra.get("stage") or {"stage": "sft"}, saved_keys(c)
    if not isinstance(before, dict):
        before = {"stage": "sft"}
    if before.get("stage") == "grpo":
        before = rollouts.saved(before)
    if before.get("stage") in ("dpo", "grpo"):
        before = {**{k: v for k, v in IMPLIED.items() if k in KEYS[before["stage"]]}, **before}
    if before.get("stage") == "kto" and before.get("precompute_ref_log_probs") is None:
        before = {**before, "precompute_ref_log_probs": False}     # saved before stage kto read the key
    if before.get("stage") == "kto" and before.get("truncation_mode") is None:
        before = {**before, "truncation_mode": "keep_start"}       # saved before stage kto read the key
    changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in now if before.get(k) != now[k]]
    if changed:
        raise ArgumentError(f"resume: {saved.path} was saved by a run with other post-training keys "
                            f"({', '.join(changed)}); a resume keeps them: set them back, or start a new run_dir")


def check_row_length(c, model) -> None:
    """stage grpo takes no seq: a row longer than the model's positions is refused naming the keys
    that set its length, max_prompt_length + max_completion_length."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and c.seq > limit:
        raise ArgumentError(f"max_prompt_length {c.max_prompt_length:,} + max_completion_length "
                            f"{c.max_completion_length:,} = {c.seq:,} tokens a row, longer than the model's "
                            f"max_position_embeddings, {limit:,}: lower max_prompt_length or max_completion_length "
                            f"so that they add up to at most {limit:,}")
