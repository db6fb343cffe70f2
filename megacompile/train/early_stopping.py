"""`early_stopping_patience` (LlamaFactory's early_stopping_steps, which adds transformers'
EarlyStoppingCallback): the run stops once its evaluation metric has not improved for that many
evaluations in a row, as the Trainer stops.

The metric is metric_for_best_model's (eval_loss by default), better as greater_is_better says
(lower for a loss). At each evaluation after a training step the count of evaluations without
improvement goes back to 0 where the metric beats the best of the evaluations before it (or there
is none yet), and up by one otherwise; the evaluation then becomes the best where it beats it (the
first always does, a NaN excepted). eval_on_start's evaluation, before any step, changes neither,
as in the Trainer. When the count reaches the patience the run writes a checkpoint of that step
(marked stopped) and ends as a finished run ends: load_best_model_at_end loads its best checkpoint,
the model is written, and the same command run again says the run is complete. The count and the
best ride in each checkpoint, so a resumed run goes on counting.
"""
from __future__ import annotations

import math

from ..errors import ArgumentError
from .config_values import integer

KEY = "early_stopping_patience"


def metric(c) -> tuple[str, bool]:
    """(the metric's name, whether greater is better) as the Trainer reads metric_for_best_model."""
    name = c.metric_for_best_model or "loss"
    name = name if name.startswith("eval_") else f"eval_{name}"
    greater = c.greater_is_better if c.greater_is_better is not None else not name.endswith("loss")
    return name, greater


def check(c) -> None:
    """The key read, before anything is opened."""
    if c.early_stopping_patience is None:
        return
    c.early_stopping_patience = integer(KEY, c.early_stopping_patience)
    if not c.eval_every or not (c.eval or c.eval_fraction):
        raise ArgumentError(f"{KEY} (early_stopping_steps) stops the run when its evaluations stop improving: give "
                            "held-out data (eval or eval_fraction) and eval_every (eval_steps)")


def check_metric(c, columns: list[str]) -> None:
    """Once the stage's columns are known: the metric is one it evaluates."""
    if c.early_stopping_patience is None:
        return
    name, _ = metric(c)
    evaluated = [k for k in columns if k.startswith("eval_")]
    if name not in evaluated:
        raise ArgumentError(f"{KEY}: metric_for_best_model {name} is not evaluated by stage {c.stage}; it evaluates "
                            f"{', '.join(evaluated)}")


class Patience:
    """The evaluations without improvement so far, and the best metric, kept in each checkpoint."""

    def __init__(self, c, saved: dict | None):
        self.patience = c.early_stopping_patience
        self.name, self.greater = metric(c)
        found = (saved or {}).get("early_stopping") or {}
        self.best, self.waited = found.get("best"), found.get("waited", 0)

    def evaluated(self, row: dict) -> None:
        """A training step's evaluation, `row` (its logged figures)."""
        if self.patience is None or row.get(self.name) is None:
            return
        value = row[self.name]
        better = (lambda a, b: a > b) if self.greater else (lambda a, b: a < b)
        if self.best is None or (better(value, self.best) and abs(value - self.best) > 0):
            self.waited = 0
        else:
            self.waited += 1
        if self.best is None:
            self.best = -math.inf if self.greater else math.inf
        if better(value, self.best):
            self.best = value

    @property
    def stop(self) -> bool:
        return self.patience is not None and self.waited >= self.patience

    def extra(self) -> dict:
        """What a checkpoint keeps of it (nothing where the run has no patience)."""
        if self.patience is None:
            return {}
        return {"early_stopping": {"best": self.best, "waited": self.waited, "stopped": self.stop}}

    def line(self, step: int) -> str:
        return (f"  early stop     step {step}: {self.name} has not improved for {self.waited} evaluation"
                f"{'s' * (self.waited != 1)} ({KEY} {self.patience}; best {self.best:.6g})")


def stopped(extra: dict) -> bool:
    """Whether a checkpoint's run stopped early (its extra, as Patience.extra wrote it)."""
    return bool((extra.get("early_stopping") or {}).get("stopped"))
