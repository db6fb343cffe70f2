"""Rewards as Python callables, as TRL's reward_funcs take them: f(prompts, completions, **columns)
-> one float per completion (None: not scored by this function, counted as 0). Several are summed
with weights. Built in: an exact-match answer and a format check."""
from __future__ import annotations

import importlib
import re
from typing import Callable, Sequence

import torch

from ..errors import ArgumentError

RewardFn = Callable[..., Sequence[float | None]]


def load(name: str) -> RewardFn:
    """`module:function` (as named in a run.yaml), or a built-in's name."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ArgumentError(f"a reward function is named module:function or one of {', '.join(BUILT_IN)}; got {name!r}")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ArgumentError(f"reward function {name!r} cannot be loaded: {e}") from e


def score(funcs: Sequence[RewardFn], weights: Sequence[float] | None, prompts, completions,
          **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of every function's rewards, (N,), and each function's own, by its name."""
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ArgumentError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    each = {}
    total = torch.zeros(len(completions), dtype=torch.float32)
    for f, w in zip(funcs, weights):
        values = list(f(prompts, completions, **columns))
        if len(values) != len(completions):
            raise ArgumentError(f"reward function {getattr(f, '__name__', f)} returned {len(values)} rewards "
                                f"for {len(completions)} completions")
        r = torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32)
        each[getattr(f, "__name__", str(f))] = r
        total += w * r
    return total, each


def exact_answer(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion's text, stripped, is the record's `answer` column, else 0.0."""
    if answer is None:
        raise ArgumentError("the exact_answer reward needs an `answer` column in the data")
    return [float(str(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_check(prompts, completions, pattern: str = r"^<answer>.*</answer>$", **_) -> list[float]:
    """1.0 where the completion matches `pattern` (by default: the whole of it in <answer> tags)."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(bool(rx.match(str(c).strip()))) for c in completions]


BUILT_IN: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_check": format_check}
