"""Stage grpo's keys (keys.py lists them with their defaults): each checked, TRL's generation batch
resolved into steps_per_generation, and the generator's keys handed to rollouts.py."""
from __future__ import annotations

from ...errors import ArgumentError
from ...posttrain import advantages, grpo, sampling_filters
from . import rollouts
from .checks import loss_type_in, note, number, positive, reference_updates

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def check(c, raw: dict, folder: str | None = None, files: bool = True) -> None:
    """Stage grpo's keys, in place, its defaults filled in (keys.py); `folder`: the run.yaml's.
    files False: the reward functions' modules are not imported (a run read for its model alone)."""
    c.beta = number("beta", c.beta)
    if c.beta < 0:
        raise ArgumentError(f"beta must be >= 0 (0 turns the KL term off, as TRL's default); got {c.beta!r}")
    loss_type_in(c, grpo.LOSS_TYPES)
    for key, least in (("num_generations", 2), ("max_prompt_length", 1), ("max_completion_length", 1),
                       ("num_iterations", 1)):
        value = getattr(c, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ArgumentError(f"{key} must be a whole number >= {least}; got {value!r}"
                                + ("; a group of one completion has no advantage" if key == "num_generations" else ""))
    _eval_generations(c)
    reference_updates(c, "beta 0 turns the KL term off: there is none to update; give beta > 0" if c.beta == 0 else None)
    c.temperature = number("temperature", c.temperature)
    if c.temperature <= 0:
        raise ArgumentError(f"temperature must be > 0 (1.0: the policy's own distribution): it divides the logits of "
                            f"the sampler and of the training log-probabilities, as in TRL; got {c.temperature!r}")
    _generation_kwargs(c, raw)
    for key in ("top_p", "min_p", "repetition_penalty"):
        if isinstance(getattr(c, key), str):
            setattr(c, key, number(key, getattr(c, key)))
    sampling_filters.check(c.top_k, c.top_p, c.min_p, c.repetition_penalty)
    c.scale_rewards = advantages.scale_of(c.scale_rewards)
    if c.off_policy_mask_threshold is not None:
        c.off_policy_mask_threshold = number("off_policy_mask_threshold", c.off_policy_mask_threshold)
    if c.multi_objective_aggregation not in AGGREGATIONS:
        raise ArgumentError(f"multi_objective_aggregation must be sum_then_normalize (TRL's default: the weighted "
                            f"rewards summed, then scaled as scale_rewards says) or normalize_then_sum (GDPO: each "
                            f"function's rewards normalised in their group, then summed, then over the batch); got "
                            f"{c.multi_objective_aggregation!r}")
    if not isinstance(c.use_bias_correction_kl, bool):
        raise ArgumentError(f"use_bias_correction_kl must be true or false (TRL's default true weighs the KL term "
                            f"by the importance weight); got {c.use_bias_correction_kl!r}")
    if not isinstance(c.mask_truncated_completions, bool):
        raise ArgumentError(f"mask_truncated_completions must be true or false; got {c.mask_truncated_completions!r}")
    if c.importance_sampling_level not in grpo.LEVELS:
        raise ArgumentError(f"importance_sampling_level must be one of {', '.join(grpo.LEVELS)} (sequence: GSPO); "
                            f"got {c.importance_sampling_level!r}")
    if c.delta is not None:
        c.delta = number("delta", c.delta)
        if c.delta <= 1:
            raise ArgumentError(f"delta caps the importance weight from above (two-sided clipping) and must be > 1, "
                                f"above 1 + epsilon_high (INTELLECT-2 uses 4); got {c.delta!r}")
    c.top_entropy_quantile = number("top_entropy_quantile", c.top_entropy_quantile)
    if not 0.0 <= c.top_entropy_quantile <= 1.0:
        raise ArgumentError(f"top_entropy_quantile must be in [0, 1] (1: every token; the paper uses 0.2); got "
                            f"{c.top_entropy_quantile!r}")
    if not isinstance(c.log_completions, bool):
        raise ArgumentError(f"log_completions must be true or false; got {c.log_completions!r}")
    shown = c.num_completions_to_print
    if shown is not None and (isinstance(shown, bool) or not isinstance(shown, int) or shown < 0):
        raise ArgumentError(f"num_completions_to_print is how many of each rollout's completions to print, a whole "
                            f"number >= 0 (all when left out); got {shown!r}")
    c.sapo_temperature_pos = positive("sapo_temperature_pos", c.sapo_temperature_pos)
    c.sapo_temperature_neg = positive("sapo_temperature_neg", c.sapo_temperature_neg)
    for key in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef"):
        setattr(c, key, number(key, getattr(c, key)))
    c.epsilon = number("epsilon", c.epsilon)
    if not 0 < c.epsilon < 1:
        raise ArgumentError(f"epsilon must be in (0, 1), e.g. 0.2; got {c.epsilon!r}")
    if c.epsilon_high is not None and number("epsilon_high", c.epsilon_high) <= 0:
        raise ArgumentError(f"epsilon_high must be positive (DAPO uses 0.28); got {c.epsilon_high!r}")
    if c.loss_type == "cispo" and c.epsilon_high is None:
        note(f"loss_type cispo caps each token's weight at epsilon_high itself, here epsilon's {c.epsilon:g} as in "
              "TRL; ScaleRL uses 5.0 (epsilon_high: 5.0)")
    funcs = [c.reward_funcs] if isinstance(c.reward_funcs, str) else c.reward_funcs
    if not isinstance(funcs, list) or not funcs or not all(isinstance(f, str) and f for f in funcs):
        raise ArgumentError(f"reward_funcs is a list of reward functions, each module:function (or TRL's "
                            f"module.function, or FILE.py:function), a built-in (exact_answer, format_check) or a "
                            f"reward model's folder; got {c.reward_funcs!r}")
    from ...posttrain import rewards
    if files:
        # importable now, and taking TRL's keywords: refused before the model is read (the data's
        # columns are checked against them once read, before the run folder is written: grpo.py)
        rewards.check_callable([rewards.load(name, near=folder) for name in funcs])
    # a reward model's folder, as found (beside the run.yaml, say): the stage reads it from there
    c.reward_funcs = [rewards.model_folder(name, folder) or name for name in funcs]
    if c.reward_weights is not None:
        weights = c.reward_weights
        if not isinstance(weights, list) or len(weights) != len(funcs):
            raise ArgumentError(f"reward_weights is a list of one number per reward function ({len(funcs)}); got "
                                f"{weights!r}")
        c.reward_weights = [number("reward_weights", w) for w in weights]
    _generation_batch(c)
    per_rollout = rollout_steps(c)
    for key in ("steps", "save_every"):
        value = getattr(c, key)
        if isinstance(value, float):        # a fraction of steps that epochs leave unknown until the data is read
            raise ArgumentError(f"{key} {value} is a fraction of the steps, which epochs give once the prompts are "
                                f"read, and a checkpoint must fall between rollout batches of {per_rollout} optimizer "
                                f"steps: give {key} in steps, a multiple of {per_rollout}, or epoch")
        if isinstance(value, int) and value % per_rollout:
            raise ArgumentError(f"{key} {value} must be a multiple of {per_rollout}, the optimizer steps of a rollout "
                                f"batch (steps_per_generation {c.steps_per_generation} / grad_accum {c.grad_accum} x "
                                f"num_iterations {c.num_iterations}): a checkpoint falls between rollout batches")
    c.seq = c.max_prompt_length + c.max_completion_length
    rollouts.check(c, raw)


def _generation_batch(c) -> None:
    """TRL's generation batch: batch x steps_per_generation completions sampled at once, then cut
    into steps_per_generation micro-batches of `batch` rows; grad_accum of them make an optimizer
    step. steps_per_generation defaults to grad_accum (one optimizer step per rollout batch);
    generation_batch_size is the other way to give it. After this, generation_batch_size is None."""
    for key in ("steps_per_generation", "generation_batch_size"):
        value = getattr(c, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ArgumentError(f"{key} must be a whole number >= 1; got {value!r}")
    if c.steps_per_generation is not None and c.generation_batch_size is not None:
        # TRL's config dump writes both, the one it derived from the other
        if c.generation_batch_size != c.batch * c.steps_per_generation:
            raise ArgumentError(f"steps_per_generation {c.steps_per_generation} and generation_batch_size "
                                f"{c.generation_batch_size} disagree (generation_batch_size = batch {c.batch} x "
                                "steps_per_generation): give one")
        c.generation_batch_size = None
    if c.generation_batch_size is not None:
        if c.generation_batch_size % c.batch:
            raise ArgumentError(f"generation_batch_size {c.generation_batch_size} must be a multiple of batch "
                                f"{c.batch} (TRL's per_device_train_batch_size): it is cut into micro-batches of "
                                "batch rows")
        c.steps_per_generation = c.generation_batch_size // c.batch
    elif c.steps_per_generation is None:
        c.steps_per_generation = c.grad_accum           # TRL's default
    c.generation_batch_size = None
    if c.steps_per_generation % c.grad_accum:
        raise ArgumentError(f"steps_per_generation {c.steps_per_generation} must be a multiple of grad_accum "
                            f"{c.grad_accum}: here each rollout batch trains whole optimizer steps (a new rollout "
                            f"inside an optimizer step is not supported); give steps_per_generation "
                            f"{c.grad_accum * -(-c.steps_per_generation // c.grad_accum)}")
    rows = c.batch * c.steps_per_generation
    if rows % c.num_generations:
        raise ArgumentError(f"the rollout batch, batch {c.batch} x steps_per_generation {c.steps_per_generation} = "
                            f"{rows} completions (TRL's generation_batch_size), must be a multiple of num_generations "
                            f"{c.num_generations}: it holds whole groups of completions of a prompt")


def _eval_generations(c) -> None:
    """num_generations_eval: None evaluates one greedy completion of each held-out prompt; n samples
    n of each at the rollouts' temperature and filters, as TRL evaluates (its default, n =
    num_generations, is given here by naming it), `batch` rows a call."""
    n = c.num_generations_eval
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ArgumentError(f"num_generations_eval must be a whole number >= 1 (completions sampled of each held-out "
                            f"prompt), or null for one greedy completion of each; got {n!r}")
    if c.batch % n:
        raise ArgumentError(f"num_generations_eval {n} must divide batch {c.batch}: evaluation generates batch rows "
                            f"a call, whole groups of completions of a prompt (TRL asks the same of its eval batch); "
                            f"give a divisor of {c.batch}")


def rollout_steps(c) -> int:
    """The optimizer steps one rollout batch trains: its micro-batches make steps_per_generation /
    grad_accum steps, num_iterations times."""
    return c.steps_per_generation // c.grad_accum * c.num_iterations


def epoch_steps(c, prompts: int, epochs: float) -> int:
    """The optimizer steps `epochs` passes over `prompts` training prompts make: rollout batches of
    batch x steps_per_generation / num_generations prompts, rollout_steps of them each."""
    groups = c.batch * c.steps_per_generation // c.num_generations
    return max(1, -(-int(epochs * prompts) // groups)) * rollout_steps(c)


def training_prompts(c) -> int:
    """The prompts a run trains on, counted from its data's records without reading them further:
    one a record, less what eval_fraction holds out (stages/grpo.py reads and checks them)."""
    from ..data.reading import records
    n = sum(1 for entry in c.data for _ in records(entry))
    return n - max(1, round(c.eval_fraction * n)) if c.eval_fraction else n


FILTERS = ("top_k", "top_p", "min_p", "repetition_penalty")


def _generation_kwargs(c, raw: dict) -> None:
    """TRL's generation_kwargs, which override its sampling keys: the sampling filters are read from
    it (and said where they override a key given too); anything else is refused, naming it. After
    this, generation_kwargs is None and the filters hold what it gave."""
    given = c.generation_kwargs
    c.generation_kwargs = None
    if not given:
        return
    if not isinstance(given, dict):
        raise ArgumentError(f"generation_kwargs is a mapping of sampling settings (TRL's), e.g. {{top_k: 50}}; got "
                            f"{given!r}")
    if "temperature" in given:
        raise ArgumentError("generation_kwargs: temperature divides the training log-probabilities too, so it is a "
                            "key of its own: give temperature: and leave it out of generation_kwargs")
    other = [k for k in given if k not in FILTERS]
    if other:
        raise ArgumentError(f"generation_kwargs: {', '.join(map(str, other))} "
                            f"{'is' if len(other) == 1 else 'are'} not supported; rollouts take "
                            f"{', '.join(FILTERS)} (and temperature, as its own key)")
    for key, value in given.items():
        if raw.get(key) is not None and raw[key] != value:
            note(f"generation_kwargs' {key} {value!r} overrides {key}: {raw[key]!r}, as in TRL")
        setattr(c, key, value)
