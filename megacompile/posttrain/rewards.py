"""Rewards as Python callables, called as TRL's GRPOTrainer calls them: with keywords only,

    f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns) -> one reward each

prompts: each completion's prompt as the record gave it (text, or a list of messages);
completions: the decoded text, or, for a prompt given as messages, a list of one message
[{"role": "assistant", "content": text}]; completion_ids: the completion's token ids (a list);
trainer_state: a TrainerState (global_step, epoch, max_steps); columns: every other column of the
records, one value per completion. A reward of None or NaN means "not scored by this function": it
is left out of the weighted sum (a nansum over the functions), and a completion no function scored
has the reward NaN (advantages.py gives it no advantage). `async def` functions are awaited
together. Built in: an exact-match answer and a format check."""
from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import ArgumentError

RewardFn = Callable[..., Sequence[float | None]]


@dataclass(frozen=True)
class TrainerState:
    """What a reward function reads of the run as TRL's `trainer_state` (transformers'
    TrainerState): global_step, the optimizer steps done before the rollout; epoch, the passes over
    the prompts done (a fraction); max_steps, the run's steps."""
    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


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


def name_of(f: RewardFn) -> str:
    return getattr(f, "__name__", str(f))


def score(funcs: Sequence[RewardFn], weights: Sequence[float] | None, prompts, completions, *,
          completion_ids=None, trainer_state: TrainerState | None = None,
          **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted nansum of every function's rewards, (N,) (NaN where no function scored), and
    each function's own (NaN where it did not score), by its name."""
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ArgumentError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    kwargs = {"prompts": list(prompts), "completions": list(completions),
              "completion_ids": [list(x) for x in completion_ids] if completion_ids is not None else None,
              "trainer_state": trainer_state if trainer_state is not None else TrainerState(), **columns}
    for f in funcs:
        _check_signature(f, kwargs)
    outputs = {i: f(**kwargs) for i, f in enumerate(funcs) if not inspect.iscoroutinefunction(f)}
    waiting = [(i, f) for i, f in enumerate(funcs) if inspect.iscoroutinefunction(f)]
    if waiting:
        async def together():
            return await asyncio.gather(*(f(**kwargs) for _, f in waiting))
        outputs.update(zip([i for i, _ in waiting], asyncio.run(together())))
    each, per_function = {}, []
    for i, f in enumerate(funcs):
        values = list(outputs[i])
        if len(values) != len(completions):
            raise ArgumentError(f"reward function {name_of(f)} returned {len(values)} rewards for "
                                f"{len(completions)} completions")
        r = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        each[name_of(f)] = r
        per_function.append(r * weights[i])
    stacked = torch.stack(per_function, dim=1)                          # (N, functions)
    total = torch.nansum(stacked, dim=1)
    total[torch.isnan(stacked).all(dim=1)] = math.nan
    return total, each


def _check_signature(f: RewardFn, kwargs: dict) -> None:
    """A function that cannot take TRL's keywords is refused naming them, not with Python's TypeError
    from inside the run."""
    try:
        inspect.signature(f).bind(**kwargs)
    except TypeError as e:
        raise ArgumentError(f"reward function {name_of(f)} is called as TRL calls reward functions, with keywords "
                            f"{', '.join(kwargs)} (the data's columns among them); name its parameters prompts and "
                            f"completions and end them with **kwargs: {e}") from e
    except ValueError:
        pass                # a builtin without a signature: called as it is


def text_of(completion) -> str:
    """A completion's text, given as text or as TRL's list of one assistant message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_answer(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion's text, stripped, is the record's `answer` column, else 0.0."""
    if answer is None:
        raise ArgumentError("the exact_answer reward needs an `answer` column in the data")
    return [float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_check(prompts, completions, pattern: str = r"^<answer>.*</answer>$", **_) -> list[float]:
    """1.0 where the completion matches `pattern` (by default: the whole of it in <answer> tags)."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(bool(rx.match(text_of(c).strip()))) for c in completions]


BUILT_IN: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_check": format_check}
