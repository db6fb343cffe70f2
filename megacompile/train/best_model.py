"""`load_best_model_at_end`, `metric_for_best_model` and `greater_is_better` (transformers'
TrainingArguments keys, so TRL's and LlamaFactory's): the model a run leaves is its best
checkpoint's, as the Trainer's is.

As in the Trainer: the metric is read at each checkpoint from the evaluation of the same step (the
metric's name with `eval_` put before it where it has none: `loss` is `eval_loss`, the default);
lower is better for a metric ending in `loss`, higher for any other, unless greater_is_better says;
the checkpoints are saved at a multiple of the evaluation interval, so each has its evaluation;
the best checkpoint stays beside keep_last's (save_total_limit's) latest, counted among them; after
the last step the run loads the best checkpoint's weights and writes those as its model. The best
so far is in each checkpoint (`extra`), so a resumed run goes on comparing with it.
"""
from __future__ import annotations

import math
import os

from ..errors import ArgumentError
from .config_values import flag


def check(c) -> None:
    """The keys read, before anything is opened."""
    c.load_best_model_at_end = flag("load_best_model_at_end", c.load_best_model_at_end)
    if c.metric_for_best_model is not None and not isinstance(c.metric_for_best_model, str):
        raise ArgumentError(f"metric_for_best_model names an evaluation metric (loss, eval_loss, ...); got "
                            f"{c.metric_for_best_model!r}")
    if c.greater_is_better is not None:
        c.greater_is_better = flag("greater_is_better", c.greater_is_better)
    if not c.load_best_model_at_end:
        return
    metric = c.metric_for_best_model or "loss"
    c.metric_for_best_model = metric if metric.startswith("eval_") else f"eval_{metric}"
    if c.greater_is_better is None:
        c.greater_is_better = not c.metric_for_best_model.endswith("loss")
    if not (c.eval or c.eval_fraction):
        raise ArgumentError("load_best_model_at_end keeps the checkpoint whose evaluation was best: give held-out "
                            "data (eval or eval_fraction) and eval_every")
    if c.save_every is False:
        raise ArgumentError("load_best_model_at_end loads the best checkpoint at the end, and save_every: false "
                            "(save_strategy: no) writes none: give save_every, a multiple of eval_every")


def check_intervals(c, columns: list[str]) -> None:
    """Once the intervals are steps (intervals.resolve) and the stage's columns known: every
    checkpoint has an evaluation of its own step, and the metric is one the stage evaluates."""
    if not c.load_best_model_at_end:
        return
    from .intervals import due
    unjudged = next((s for s in range(1, c.steps + 1) if due(c.save_every, s, c.steps)
                     and not (c.eval_every and due(c.eval_every, s, c.steps))), None)
    if unjudged is not None:
        raise ArgumentError(f"load_best_model_at_end needs each checkpoint's step evaluated, and the checkpoint at step "
                            f"{unjudged} would have none: save_every ({_shown(c.save_every)}) must be a multiple of "
                            f"eval_every ({_shown(c.eval_every)}), as the Trainer requires of save_steps and "
                            "eval_steps")
    evaluated = [k for k in columns if k.startswith("eval_")]
    if c.metric_for_best_model not in evaluated:
        raise ArgumentError(f"metric_for_best_model {c.metric_for_best_model} is not evaluated by stage {c.stage}; "
                            f"it evaluates {', '.join(evaluated)}")


def _shown(every) -> str:
    return "epoch" if isinstance(every, tuple) else str(every)


class Best:
    """The best checkpoint so far: its step and metric, kept in each checkpoint's extra."""

    def __init__(self, c, saved: dict | None):
        self.c = c
        found = (saved or {}).get("best") or {}
        self.step, self.value = found.get("step"), found.get("value")

    def proposed(self, step: int, row: dict) -> dict | None:
        """The best after a checkpoint at `step` whose evaluation is `row` (None where not asked)."""
        if not self.c.load_best_model_at_end:
            return None
        value = row.get(self.c.metric_for_best_model)
        better = value is not None and math.isfinite(value) and (
            self.value is None or (value > self.value if self.c.greater_is_better else value < self.value))
        return {"step": step, "value": value} if better else self.state()

    def state(self) -> dict | None:
        return None if self.step is None else {"step": self.step, "value": self.value}

    def keep(self, state: dict | None) -> None:
        """`state` (proposed()'s) is the best now: its checkpoint was written."""
        if state is not None:
            self.step, self.value = state["step"], state["value"]

    def kept(self, checkpoint_path) -> tuple[str, ...]:
        """The checkpoint rotation leaves whatever its age."""
        return () if self.step is None else (checkpoint_path(self.step),)

    def load(self, engine, checkpoint_path) -> str | None:
        """After the last step: the best checkpoint's weights into `engine`; the line the run prints
        (None where the model is the last step's)."""
        if not self.c.load_best_model_at_end or self.step is None or self.step == engine.steps_done:
            return None
        path = checkpoint_path(self.step)
        if not os.path.isdir(path):
            raise ArgumentError(f"load_best_model_at_end: the best checkpoint, {path} (step {self.step}, "
                                f"{self.c.metric_for_best_model} {self.value:.6g}), is gone; the last step's weights "
                                "are in the run's latest checkpoint")
        engine.load_checkpoint(path)
        return (f"  best           step {self.step} ({self.c.metric_for_best_model} {self.value:.6g}): its checkpoint's "
                "weights are the model written (load_best_model_at_end)")
