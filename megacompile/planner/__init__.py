"""Planning: from a model and an HBM budget to a verified schedule with its predicted figures.

    result.py       Plan: the schedule, its memory curve, host bytes, bytes moved, predicted time
    search.py       make_plan: from a captured model and a budget to a verified plan (the solver's
                    judges, the host placement, the error naming the smallest budget)
    from_config.py  plan(), plan_global_batch(), minimum_budget(): from a Hugging Face config
                    or a meta model, without weights
    cache.py        PlanCache: the engine's plans, one per input signature

`megacompile.plan(config, 80)` is from_config.plan, bound in megacompile/__init__.py.
"""
from __future__ import annotations

from .result import Plan
from .search import make_plan
from .from_config import minimum_budget, model_from_config, plan, plan_global_batch


__all__ = ["Plan", "make_plan", "minimum_budget", "model_from_config", "plan", "plan_global_batch"]
