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

As the best model's (best_model.py), the best is judged by the evaluations that made it: a resume
whose evaluations differ from them (other eval files, or the same files changed; eval_batches,
eval_batch, metric_for_best_model, greater_is_better) says so (resume.notes) and counts afresh:
its first evaluation is the best so far. What judged the best is best_model.judged_under()'s, read
from the checkpoint's best model where that is the same, kept beside the count otherwise (a run
without load_best_model_at_end, or whose best checkpoint was judged by other evaluations).
"""
from __future__ import annotations

import math

from ..errors import ArgumentError
from .best_model import differences, judged_under
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
        self.c, self.patience = c, c.early_stopping_patience
        self.name, self.greater = metric(c)
        self._under = None
        found = (saved or {}).get("early_stopping") or {}
        self.best, self.waited = found.get("best"), found.get("waited", 0)
        self.changed = changes(c, saved)
        if self.changed:        # judged by other evaluations (resume_note): the next is the best
            self.best, self.waited = None, 0

    @property
    def under(self) -> dict:
        """What judges this run's evaluations (best_model.judged_under), its metric as read here."""
        if self._under is None:
            self._under = judged(self.c)
        return self._under

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

    def extra(self, best: dict | None = None) -> dict:
        """What a checkpoint keeps of it (nothing where the run has no patience); `best`: the best
        model the same checkpoint keeps (best_model.Best.proposed), whose judged_under is reused."""
        if self.patience is None:
            return {}
        kept = {"best": self.best, "waited": self.waited, "stopped": self.stop}
        if (best or {}).get("under") != self.under:
            kept["under"] = self.under
        return {"early_stopping": kept}

    def line(self, step: int) -> str:
        return (f"  early stop     step {step}: {self.name} has not improved for {self.waited} evaluation"
                f"{'s' * (self.waited != 1)} ({KEY} {self.patience}; best {self.best:.6g})")


def judged(c) -> dict:
    """best_model.judged_under(c), with the metric and its direction as metric() reads them (which
    best_model.check sets alike under load_best_model_at_end)."""
    name, greater = metric(c)
    return {**judged_under(c), "metric_for_best_model": name, "greater_is_better": greater}


def changes(c, saved: dict | None) -> list[str]:
    """How this run's evaluations differ from those that judged the count's best in a checkpoint's
    extra (`saved`), a phrase each; [] where they are alike, or where nothing says (no count, or a
    checkpoint saved before the count kept what judged it)."""
    found = (saved or {}).get("early_stopping") or {}
    before = found.get("under", ((saved or {}).get("best") or {}).get("under"))
    if c.early_stopping_patience is None or found.get("best") is None or not isinstance(before, dict):
        return []
    return differences(before, judged(c))


def resume_note(c, saved) -> list[str]:
    """The note of a resume from `saved` (resume.Saved) whose count was judged by other evaluations."""
    changed = changes(c, saved.extra)
    if not changed:
        return []
    found = saved.extra["early_stopping"]
    waited = found.get("waited", 0)
    return [f"{', '.join(changed)}: early stopping's best so far ({found['best']:.6g}, then {waited} evaluation"
            f"{'s' * (waited != 1)} without improvement) was judged by other evaluations, and this run's are not "
            f"compared with it: the count starts afresh from step {saved.steps_done + 1}, this run's first evaluation "
            f"the best so far ({KEY})"]


def stopped(extra: dict) -> bool:
    """Whether a checkpoint's run stopped early (its extra, as Patience.extra wrote it)."""
    return bool((extra.get("early_stopping") or {}).get("stopped"))
