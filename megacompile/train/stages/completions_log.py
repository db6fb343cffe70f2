"""TRL's `log_completions` for stage grpo: every rollout's completions, one JSON line each, in
run_dir/completions.jsonl, with the step they train, the prompt as the record gave it, the decoded
completion, its reward (null where no function scored it), each function's, its advantage and the
columns the reward functions added with TRL 1.16's log_extra (`extra`, where any did); and
`num_completions_to_print` of them (all when not given) printed as the rollout is made, as TRL
prints its sample table.

A resumed run drops the lines of the steps after its checkpoint, as log.csv drops its rows, so the
file holds each rollout once."""
from __future__ import annotations

import json
import math
import os

from ...io import durable

FILE = "completions.jsonl"


class CompletionsLog:
    def __init__(self, run_dir: str, steps_done: int, shown: int | None):
        """steps_done: the checkpoint's (0 for a new run, whose file starts empty)."""
        self.path, self.shown = os.path.join(run_dir, FILE), shown
        kept = []
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                kept = [line for line in f if _step(line) <= steps_done]
        durable.replace_text(self.path, "".join(kept))

    def write(self, step: int, prompts: list, texts: list[str], rewards: list[float], each: dict[str, list[float]],
              advantages: list[float], extra: dict[str, list] | None = None) -> None:
        """extra: log_extra's columns, one value per completion each."""
        rows = [{"step": step, "prompt": prompt, "completion": text, "reward": _number(reward),
                 "rewards": {name: _number(values[i]) for name, values in each.items()},
                 "advantage": _number(advantages[i]),
                 **({"extra": {column: _cell(values[i]) for column, values in extra.items()}} if extra else {})}
                for i, (prompt, text, reward) in enumerate(zip(prompts, texts, rewards))]
        with open(self.path, "a", encoding="utf-8") as f:       # a value JSON has no form for, as its text
            f.write("".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
        for row in rows[:len(rows) if self.shown is None else self.shown]:
            prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1].get("content", "")
            added = "".join(f" | {column} {_line(value, 20)}" for column, value in row.get("extra", {}).items())
            print(f"  completion     step {step} | reward {_shown(row['reward'])}{added} | {_line(prompt)} -> "
                  f"{_line(row['completion'])}", flush=True)


def _step(line: str) -> float:
    """A line's step; a line a kill cut short counts as after every checkpoint (it is dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _number(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _cell(x):
    """A log_extra value as JSON holds it: NaN as null, as the rewards."""
    return None if isinstance(x, float) and math.isnan(x) else x


def _shown(x: float | None) -> str:
    return "none" if x is None else f"{x:.4f}"


def _line(text: str, width: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."
