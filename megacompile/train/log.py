"""The run's log: one CSV row per optimizer step, flushed as it is written (a run killed at any
moment keeps every step it finished), TensorBoard and W&B scalars (wandb_log.py) when asked for,
and the progress bar.

A step skipped for an inf or NaN (on_nonfinite: skip) updates nothing and counts as no step: the
next batch is that step again, under the same number. Its row keeps that number, with `skipped`
saying why (loss, gradient), and comes before the row of the step that updated; the rows whose
`skipped` is empty are one per step, in order (log.csv is also a record of what ran). TensorBoard,
W&B and trainer_log.jsonl take those rows alone, one value per step, as the Trainer's logs hold a
non-finite loss out of theirs (logging_nan_inf_filter)."""
from __future__ import annotations

import csv
import errno
import io
import math
import os
import sys

from ..errors import CheckpointError
from ..io import durable

# Every stage's columns, then the SFT stage's evaluation (a post-training stage logs its own).
STEP_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "seconds", "tokens_per_s", "device_peak_bytes",
                "predicted_device_peak_bytes", "host_resident_bytes", "skipped")
COLUMNS = STEP_COLUMNS + ("eval_loss", "eval_perplexity")


SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "device_peak_bytes", "host_resident_bytes", "eval_loss",
           "eval_perplexity")


def scalars(row: dict, extra: tuple = ()) -> dict[str, float]:
    """A row's scalars under their TensorBoard / W&B tags: train/loss, ..., eval/loss; `extra`: a
    post-training stage's own columns (train/reward, train/rewards/<function>/mean, train/kl,
    eval/reward_margin, ...), tagged the same way."""
    return {(f"eval/{key[5:]}" if key.startswith("eval") else f"train/{key}"): row[key]
            for key in SCALARS + extra if row.get(key) is not None}


class RunLog:
    def __init__(self, run_dir: str, loggers: list[str], resume_step: int, settings: dict | None = None,
                 columns: tuple = COLUMNS, steps: int | None = None, every: int = 1,
                 steps_per_epoch: int | None = None):
        """`settings`: the run's settings, W&B's run config (its name and wandb_project too);
        `columns`: the CSV's (a post-training stage logs its own); `steps`, `every`,
        `steps_per_epoch`: the run's steps, log_every and an epoch's steps (None: streamed), for
        LlamaFactory's trainer_log.jsonl beside it (trainer_log.py)."""
        self.path = os.path.join(run_dir, "log.csv")
        self._trainer = None
        if steps is not None:
            from .trainer_log import TrainerLog
            self._trainer = TrainerLog(run_dir, steps, every, resume_step, steps_per_epoch)
        columns = _keep_steps_up_to(self.path, resume_step, columns)
        self.extra = tuple(c for c in columns if c not in COLUMNS)      # a stage's figures, as scalars too
        new = not os.path.exists(self.path)
        self._columns = columns
        # Unbuffered, in whole rows: a row the disk refuses is cut off again (write), never left half
        # written where a resumed run would read it.
        self._file = open(self.path, "ab", buffering=0)
        if new:
            self._append(None, {c: c for c in columns})
        self._board = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter
            self._board = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=resume_step + 1)
        self._wandb = None
        if "wandb" in loggers:
            from .wandb_log import WandbLog
            self._wandb = WandbLog(run_dir, settings or {}, resume_step)

    def write(self, row: dict, last: bool = False) -> None:
        """last: the step early stopping ends the run at (trainer_log.jsonl logs it as the last step)."""
        new = tuple(k for k in row if k not in self._columns)
        if new:         # a figure first logged now (a reward function's log_metric): the header gains it
            self._widen(new)
        # repr: floats written so that they read back to the same bits
        self._append(row["step"], {k: repr(v) if isinstance(v, float) else ("" if v is None else v)
                                   for k, v in row.items()})
        if row.get("skipped"):      # its number is the next update's: a second value at that step
            return
        if self._board is not None:
            for tag, value in scalars(row, self.extra).items():
                self._board.add_scalar(tag, value, row["step"])
            self._board.flush()
        if self._wandb is not None:
            self._wandb.write(row["step"], scalars(row, self.extra))
        if self._trainer is not None:
            try:
                self._trainer.write(row, last)
            except OSError as e:
                raise log_failed(self._trainer.path, row["step"], e) from e

    def _widen(self, new: tuple) -> None:
        """The log's columns and then `new`, the rows written so far rewritten under that header
        (their new cells empty), in a copy renamed over the file."""
        self._file.close()
        self._columns = _keep_steps_up_to(self.path, math.inf, self._columns + new)
        self.extra += new
        self._file = open(self.path, "ab", buffering=0)

    def _append(self, step: int | None, fields: dict) -> None:
        text = io.StringIO()
        csv.DictWriter(text, self._columns).writerow(fields)
        data, at = text.getvalue().encode(), self._file.tell()
        try:
            written = self._file.write(data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            try:
                self._file.truncate(at)
            except OSError:
                pass
            raise log_failed(self.path, step, e) from e

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()
        if self._wandb is not None:
            self._wandb.close()


def log_failed(path: str, step: int | None, e: OSError) -> CheckpointError:
    """The error of a row the disk refused: what failed, and that the log holds every step before it."""
    cause = f"the disk is full ({e.strerror})" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    kept = "its header" if step is None else f"every step before step {step}"
    return CheckpointError(f"cannot write the run's log {path}: {cause}; the log keeps {kept}")


def _keep_steps_up_to(path: str, step: int, columns: tuple = COLUMNS) -> tuple:
    """A resumed run goes on from its checkpoint: rows of the steps after it are dropped (they are
    written again), in a copy renamed over the old file. The log's columns from here on: `columns`,
    and after them any the log had that they lack (a figure the run logged before its settings
    changed, such as compute_accuracy's), kept with the rows that hold it."""
    if not os.path.exists(path):
        return columns
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    columns = tuple(columns) + tuple(c for c in reader.fieldnames or () if c not in columns)
    text = io.StringIO()
    writer = csv.DictWriter(text, columns)
    writer.writeheader()
    writer.writerows(r for r in rows if int(r["step"]) <= step)
    durable.replace_text(path, text.getvalue())
    return columns


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Progress:
    """A tqdm bar (ETA, loss, tokens/s, device peak, and the latest eval loss once there is one) on
    a terminal; elsewhere a line every `every` steps."""

    def __init__(self, total: int, start: int, every: int):
        from tqdm import tqdm
        self.tty = sys.stderr.isatty()
        self.every, self.total = every, total
        self.eval_loss: float | None = None
        self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr, disable=not self.tty,
                        dynamic_ncols=True)

    def update(self, step: int, text: str, postfix: dict, eval_loss: float | None = None) -> None:
        if eval_loss is not None:
            self.eval_loss = eval_loss
        if self.tty:
            if self.eval_loss is not None:
                postfix = {**postfix, "eval": f"{self.eval_loss:.4f}"}
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step in (1, self.total):
            print(f"step {step:>5}/{self.total} | {text}", flush=True)

    def close(self) -> None:
        self.bar.close()
