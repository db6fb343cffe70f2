"""How often a run prints its progress, evaluates and saves (log_every, eval_every, save_every):
every N optimizer steps, a fraction of the run's steps, or at the end of each epoch.

    N          a whole number of steps
    0.1        a fraction below 1: ceil(0.1 x steps) steps, as transformers' TrainerState.compute_steps
               turns its logging_steps, eval_steps and save_steps below 1 into steps
    epoch      (eval_every, save_every) at the step that feeds an epoch's last rows, as
               transformers' eval_strategy and save_strategy `epoch`

A fraction becomes steps once the run's steps are known: in config.check when steps are given,
in loop.run once the data has turned epochs into steps. `epoch` becomes the steps that end each
epoch (the stage's steps_for(1), steps_for(2), ...) there too. Evaluations and checkpoints come
at those steps and after the last one.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import ArgumentError

EPOCH = "epoch"
KEYS = ("log_every", "eval_every", "save_every")


def check(key: str, value: Any) -> int | float | str:
    """A whole number >= 1, a fraction in (0, 1), or (but log_every) `epoch`."""
    if value == EPOCH and key != "log_every":
        return EPOCH
    if isinstance(value, str):      # YAML reads 1e-1 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, float) and value.is_integer() and value >= 1:
        value = int(value)          # transformers takes 500.0 as 500
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, float) and 0 < value < 1:
        return value
    raise ArgumentError(f"{key} must be a whole number >= 1 (steps), or a fraction of the run's steps above 0 and "
                        f"below 1" + ("" if key == "log_every" else ", or epoch (at the end of each epoch)")
                        + f"; got {value!r}")


def resolve(c: Any, steps_for: Callable[[float], int] | None = None) -> None:
    """Each interval of `c` as steps, now that c.steps is known; `epoch` too when `steps_for` (the
    stage's steps for a number of epochs) is given."""
    for key in KEYS:
        value = getattr(c, key)
        if isinstance(value, float):
            setattr(c, key, math.ceil(value * c.steps))
        elif value == EPOCH and steps_for is not None:
            setattr(c, key, epoch_ends(steps_for, c.steps))


def epoch_ends(steps_for: Callable[[float], int], steps: int) -> tuple[int, ...]:
    """The steps that end each epoch before the last step, and the last step (which ends a
    partial epoch, as transformers evaluates and saves there too)."""
    ends, k = [], 1
    while (end := steps_for(k)) < steps:
        if not ends or end > ends[-1]:      # an epoch shorter than a step ends at the same step as the one before
            ends.append(end)
        k += 1
    return (*ends, steps)


def evaluates(c: Any, step: int) -> bool:
    """Whether the run evaluates at `step`: eval_every's steps, and step 0 (before the first
    update) with eval_on_start, as transformers' eval_on_start."""
    return (step == 0 and c.eval_on_start) or (step > 0 and due(c.eval_every, step, c.steps))


def due(every: Any, step: int, last: int) -> bool:
    """Whether `step` is one of a resolved interval's steps, or the last step."""
    if step == last:
        return True
    if isinstance(every, tuple):
        return step in every
    return bool(every) and step % every == 0
