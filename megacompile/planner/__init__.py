"""Planning: from a model and an HBM budget to a verified schedule with its predicted figures.

    result.py       Plan: the schedule, its memory curve, host bytes, bytes moved, predicted time
    search.py       make_plan: from a captured model and a budget to a verified plan (the solver's
                    judges, the host placement, the error naming the smallest budget)
    from_config.py  plan(), plan_global_batch(), minimum_budget(): from a Hugging Face config
                    or a meta model, without weights
    quantized.py    a quantized checkpoint's config: planned in full precision with a note, its
                    weights refused at load
    image_inputs.py the meta batch of a vision-language model's rows with images, as its
                    processor lays them out
    vision_share.py the vision tower's share of a plan's predicted time and device peak
    cache.py        PlanCache: the engine's plans, one per input signature
    judged.py       the peaks and seconds judged of a captured model, kept for its next plans
    posttrain_step.py  plan_stage(): a post-training stage's step (sft, pt, dpo, kto, rm, grpo) from its parts,
                    each a training step or forward-only pass planned as plan() plans it

`megacompile.plan(config, 80)` is from_config.plan, bound in megacompile/__init__.py.
"""
from __future__ import annotations

from .result import Plan
from .search import make_plan
from .from_config import minimum_budget, model_from_config, plan, plan_global_batch
from .posttrain_step import StagePlan, engine_generator_advice, plan_stage
from .from_config import choose_micro_batch, minimum_budget_of, split_fields, split_line
from .quantized import refuse_quantized_weights
from .image_inputs import grid_tokens, image_inputs, sized_by_area


__all__ = ["Plan", "StagePlan", "make_plan", "minimum_budget", "model_from_config", "plan", "plan_global_batch",
           "plan_stage", "engine_generator_advice", "choose_micro_batch", "minimum_budget_of",
           "refuse_quantized_weights", "grid_tokens", "image_inputs", "sized_by_area", "split_fields", "split_line"]
