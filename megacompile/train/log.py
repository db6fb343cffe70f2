"""The run's log: one CSV row per optimizer step, flushed as it is written (a run killed at any
moment keeps every step it finished), TensorBoard scalars when asked for, and the progress bar."""
from __future__ import annotations

import csv
import os
import sys

COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "seconds", "tokens_per_s", "device_peak_bytes",
           "predicted_device_peak_bytes", "skipped", "eval_loss", "eval_perplexity")


class RunLog:
    def __init__(self, run_dir: str, loggers: list[str], resume_step: int):
        self.path = os.path.join(run_dir, "log.csv")
        _keep_steps_up_to(self.path, resume_step)
        new = not os.path.exists(self.path)
        self._file = open(self.path, "a", newline="")
        self._csv = csv.DictWriter(self._file, COLUMNS)
        if new:
            self._csv.writeheader()
            self._file.flush()
        self._board = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter
            self._board = SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=resume_step + 1)

    def write(self, row: dict) -> None:
        # repr: floats written so that they read back to the same bits
        self._csv.writerow({k: repr(v) if isinstance(v, float) else ("" if v is None else v) for k, v in row.items()})
        self._file.flush()
        if self._board is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "device_peak_bytes", "eval_loss", "eval_perplexity"):
                if row.get(key) is not None:
                    self._board.add_scalar(f"train/{key}" if not key.startswith("eval") else f"eval/{key[5:]}",
                                           row[key], row["step"])
            self._board.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()


def _keep_steps_up_to(path: str, step: int) -> None:
    """A resumed run goes on from its checkpoint: rows of the steps after it are dropped (they are
    written again), in a copy renamed over the old file."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(r for r in rows if int(r["step"]) <= step)
    os.replace(path + ".tmp", path)


def read(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


class Progress:
    """A tqdm bar (ETA, loss, tokens/s, device peak) on a terminal; elsewhere a line every
    `every` steps."""

    def __init__(self, total: int, start: int, every: int):
        from tqdm import tqdm
        self.tty = sys.stderr.isatty()
        self.every, self.total = every, total
        self.bar = tqdm(total=total, initial=start, unit="step", file=sys.stderr, disable=not self.tty,
                        dynamic_ncols=True)

    def update(self, step: int, text: str, postfix: dict) -> None:
        if self.tty:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step in (1, self.total):
            print(f"step {step:>5}/{self.total} | {text}", flush=True)

    def close(self) -> None:
        self.bar.close()
