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

With the best is saved what judged it (judged_under): the metric and its direction, the held-out
data and how an evaluation reads it. A resume under which those differ (other eval files, or the
same files changed; eval_batches, eval_batch, metric_for_best_model, greater_is_better) would
compare its evaluations with one they do not measure alike: it says so (resume.notes), and the
best is judged afresh among its own evaluations: the first one is the best so far. A run with no
evaluation left (complete) keeps the best it had.
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


def judged_under(c) -> dict:
    """What an evaluation's metric depends on beside the weights: the metric and its direction, the
    held-out data (the eval files' entries with each file's path, size and time, or eval_fraction's
    share), the eval batches an evaluation reads at most and their rows."""
    files = None
    if c.eval:
        from .data.tokens import fingerprint, sources
        files = sources(fingerprint(c.eval, None, False))["files"]
    return {"metric_for_best_model": c.metric_for_best_model, "greater_is_better": c.greater_is_better,
            "eval": files, "eval_fraction": c.eval_fraction, "eval_batches": c.eval_batches,
            "eval_batch": c.eval_batch or c.batch}


def changes(c, saved: dict | None) -> list[str]:
    """How this run's evaluations differ from those that judged the best of a checkpoint's extra
    (`saved`), a phrase each; [] where they are alike, or where nothing says (a checkpoint without
    a best, or one saved before the best kept what judged it)."""
    best = (saved or {}).get("best") or {}
    before = best.get("under")
    if not c.load_best_model_at_end or best.get("step") is None or not isinstance(before, dict):
        return []
    return differences(before, judged_under(c))


def differences(before: dict, now: dict) -> list[str]:
    """How the evaluations judged_under() described as `now` differ from those it described as
    `before`, a phrase each (early_stopping.py's too)."""
    out = [f"{k} {before[k]} -> {v}" for k, v in now.items() if k != "eval" and k in before and before[k] != v]
    if "eval" in before and before["eval"] != now["eval"]:
        out.append(_eval_change(before["eval"], now["eval"]))
    return out


def _eval_change(before: list | None, now: list | None) -> str:
    """The phrase for other eval entries (data/tokens.py's sources: each entry's files with their
    sizes and times, and its settings)."""
    def files(entries) -> dict:
        return {f["path"]: (f.get("bytes"), f.get("mtime_ns")) for e in entries or [] for f in e.get("files") or []}

    def some(paths) -> str:
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "") if paths else "none"
    a, b = files(before), files(now)
    if a.keys() != b.keys():
        return f"eval {some(sorted(a))} -> {some(sorted(b))}"
    changed = sorted(p for p in a if a[p] != b[p])
    return (f"eval: {some(changed)} changed (another size or modification time)" if changed
            else "eval: its entries' settings changed")


def resume_note(c, saved) -> list[str]:
    """The note of a resume from `saved` (resume.Saved) whose best was judged by other evaluations."""
    changed = changes(c, saved.extra)
    if not changed:
        return []
    best = saved.extra["best"]
    metric = best["under"].get("metric_for_best_model", c.metric_for_best_model)
    return [f"{', '.join(changed)}: the best checkpoint so far (step {best['step']}, {metric} {best['value']:.6g}) was "
            f"judged by other evaluations, and this run's are not compared with it: the best is judged afresh from "
            f"step {saved.steps_done + 1}, among this run's evaluations (load_best_model_at_end)"]


class Best:
    """The best checkpoint so far: its step and metric and what judged it, kept in each checkpoint's
    extra."""

    def __init__(self, c, saved: dict | None):
        self.c = c
        found = (saved or {}).get("best") or {}
        self.step, self.value, self.judged = found.get("step"), found.get("value"), found.get("under")
        self.under = judged_under(c) if c.load_best_model_at_end else None
        # judged by other evaluations (resume_note): the next evaluation is the best, whatever its value
        self.stale = bool(changes(c, saved))

    def proposed(self, step: int, row: dict) -> dict | None:
        """The best after a checkpoint at `step` whose evaluation is `row` (None where not asked)."""
        if not self.c.load_best_model_at_end:
            return None
        value = row.get(self.c.metric_for_best_model)
        better = value is not None and math.isfinite(value) and (
            self.value is None or self.stale
            or (value > self.value if self.c.greater_is_better else value < self.value))
        return {"step": step, "value": value, "under": self.under} if better else self.state()

    def state(self) -> dict | None:
        return None if self.step is None else {"step": self.step, "value": self.value, "under": self.judged}

    def keep(self, state: dict | None) -> None:
        """`state` (proposed()'s) is the best now: its checkpoint was written."""
        if state is not None:
            self.stale = self.stale and state == self.state()      # still the best judged otherwise
            self.step, self.value, self.judged = state["step"], state["value"], state.get("under")

    def kept(self, checkpoint_path) -> tuple[str, ...]:
        """The checkpoint rotation leaves whatever its age."""
        return () if self.step is None else (checkpoint_path(self.step),)

    def load(self, engine, checkpoint_path, written: bool = True) -> str | None:
        """After the last step: the best checkpoint's weights into `engine`; the line the run prints
        (None where the model is the last step's). `written`: whether the run writes its model (the
        bundled model's is a checkpoint: the best one is then the model)."""
        if not self.c.load_best_model_at_end or self.step is None or self.step == engine.steps_done:
            return None
        path = checkpoint_path(self.step)
        if not os.path.isdir(path):
            raise ArgumentError(f"load_best_model_at_end: the best checkpoint, {path} (step {self.step}, "
                                f"{self.c.metric_for_best_model} {self.value:.6g}), is gone; the last step's weights "
                                "are in the run's latest checkpoint")
        engine.load_checkpoint(path)
        metric = (self.judged or {}).get("metric_for_best_model", self.c.metric_for_best_model)
        if not written:
            return (f"  best           step {self.step} ({metric} {self.value:.6g}): its checkpoint, {path}, is the "
                    "model (load_best_model_at_end; the bundled model is written nowhere else)")
        return (f"  best           step {self.step} ({metric} {self.value:.6g}): its checkpoint's "
                "weights are the model written (load_best_model_at_end)")
