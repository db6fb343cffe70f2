"""trainer_log.jsonl, as LlamaFactory writes it beside its checkpoints: the file LlamaBoard draws its
loss curve from and users' scripts read (`current_steps`, `loss`, `eval_loss`, ...).

A line every `log_every` steps (the Trainer's logging_steps) and after the last one (the one early
stopping ends the run at too, as trainer_state.json's log_history has a record there), whose loss is
the mean of the steps' losses since the line before, rounded to 4 places, as transformers' Trainer
logs it; a line of its own for each evaluation; each with the steps done and to do, the percentage
and LlamaFactory's elapsed and remaining times (h:mm:ss, from this process's start). Keys without a
value are left out, as LlamaFactory leaves them: `epoch` (the step over an epoch's steps, as
trainer_state.json's log_history has it: results.py) is left out of a streamed run's, whose epoch
length is unknown. A resumed run drops the lines past its checkpoint first, as log.csv drops its rows,
and its first loss line averages the steps since the last line kept (their losses read back from
log.csv), so the file is the uninterrupted run's.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from datetime import timedelta

from ..io import durable

NAME = "trainer_log.jsonl"


class TrainerLog:
    def __init__(self, run_dir: str, steps: int, every: int, resume_step: int, steps_per_epoch: int | None = None):
        """steps_per_epoch: the optimizer steps of an epoch (None: streamed, no epoch written)."""
        self.path = os.path.join(run_dir, NAME)
        self.steps, self.every, self.steps_per_epoch = steps, max(1, every), steps_per_epoch
        self.started = time.time()
        _keep_steps_up_to(self.path, resume_step)
        # the losses of the steps since the last line kept, which the uninterrupted run held when it
        # saved the checkpoint: the resumed run's next line averages them too
        self.losses = _unlogged_losses(run_dir, self.path, resume_step) if resume_step else []

    def write(self, row: dict, last: bool = False) -> None:
        """last: the run ends at this step before `steps` (early stopping), which logs as the last does."""
        step, loss = row["step"], row.get("loss")
        if isinstance(loss, float) and math.isfinite(loss) and not row.get("skipped"):
            self.losses.append(loss)
        if step and (step % self.every == 0 or step == self.steps or last):     # step 0: eval_on_start's alone
            mean = round(sum(self.losses) / len(self.losses), 4) if self.losses else None
            self._line(step, loss=mean, lr=row.get("lr"))
            self.losses = []
        if row.get("eval_loss") is not None:
            self._line(step, eval_loss=row["eval_loss"])

    def _line(self, step: int, **figures) -> None:
        elapsed = time.time() - self.started
        remaining = (self.steps - step) * elapsed / step if step else 0.0
        line = {"current_steps": step, "total_steps": self.steps, **figures,
                "epoch": epoch_of(step, self.steps_per_epoch).get("epoch"),
                "percentage": round(step / self.steps * 100, 2) if self.steps else 100,
                "elapsed_time": str(timedelta(seconds=int(elapsed))),
                "remaining_time": str(timedelta(seconds=int(remaining)))}
        with open(self.path, "a", encoding="utf-8") as f:      # an OSError: the run's log says it (log.py)
            f.write(json.dumps({k: v for k, v in line.items() if v is not None}) + "\n")


def _keep_steps_up_to(path: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:     # a line cut short by a kill is dropped too
        kept = [line for line in f if (at := _step(line)) is not None and at <= step]     # eval_on_start's: 0
    durable.replace_text(path, "".join(kept))


def _unlogged_losses(run_dir: str, path: str, step: int) -> list[float]:
    """The losses log.csv holds of the steps after the file's last loss line (not an evaluation's)
    up to `step`, the steps that updated alone, as write() gathers them."""
    last = 0
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        last = max((x["current_steps"] for x in lines if "eval_loss" not in x), default=0)
    csv_path, out = os.path.join(run_dir, "log.csv"), []
    if not os.path.exists(csv_path):
        return out
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            if last < int(r["step"]) <= step and r.get("skipped") in ("", None, "None", "False") and r.get("loss"):
                loss = float(r["loss"])
                if math.isfinite(loss):
                    out.append(loss)
    return out


def _step(line: str) -> int | None:
    try:
        return int(json.loads(line)["current_steps"])
    except (ValueError, TypeError, KeyError):
        return None


def epoch_of(step: int, steps_per_epoch: int | None) -> dict:
    """A log record's epoch at `step`, as the Trainer logs it (trainer_state.json's log_history too:
    results.py); {} when streamed, an epoch's length unknown."""
    return {"epoch": round(step / steps_per_epoch, 4)} if steps_per_epoch else {}
