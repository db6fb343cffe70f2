"""What reward functions log through the two callables TRL 1.16's GRPOTrainer hands them beside
their rewards, with its meanings:

    log_metric(name, value)    a scalar, kept under `name`: the values of one scoring (a rollout
                               batch, or an evaluation) averaged, as TRL averages them into the
                               step's logged metrics (an evaluation's named eval_NAME, as TRL's)
    log_extra(column, values)  one value per completion, a column added to the completions log
                               (TRL's completions table; log_completions here)

A function may call them any number of times; the values of a name (or a column) accumulate until
the scoring is done, as TRL's buffers do until it flushes them."""
from __future__ import annotations

import math

from ..errors import ArgumentError


class RewardLogs:
    """The buffers of one scoring; `log_metric` and `log_extra` are the callables the functions get."""

    def __init__(self):
        self.values: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"log_metric(name, value) takes the metric's name as text; got {name!r}")
        try:
            number = float(value)
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"log_metric({name!r}, value) takes one number (TRL averages them over the rollout "
                                f"batch); got {value!r}") from e
        self.values.setdefault(name, []).append(number)

    def log_extra(self, column: str, values) -> None:
        if not isinstance(column, str) or not column:
            raise ArgumentError(f"log_extra(column, values) takes the column's name as text; got {column!r}")
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ArgumentError(f"log_extra({column!r}, values) takes a list, one value per completion; got {values!r}")
        self.columns.setdefault(column, []).extend(values)

    def metrics(self, prefix: str = "", own: tuple = ()) -> dict[str, float]:
        """Each name's mean over the values logged (NaN where one of them is), named prefix + name;
        a name among `own`, the figures the stage logs itself, is refused rather than mixed with one."""
        taken = [name for name in self.values if prefix + name in own]
        if taken:
            raise ArgumentError(f"a reward function logged {taken[0]!r} (log_metric), a figure the stage logs itself "
                                f"as {prefix + taken[0]}: give the metric another name")
        return {prefix + name: math.fsum(v) / len(v) for name, v in self.values.items()}

    def extra(self, completions: int) -> dict[str, list]:
        """The columns logged, each one value per completion: a column of another length is refused,
        as TRL's table cannot hold it either."""
        for column, values in self.columns.items():
            if len(values) != completions:
                raise ArgumentError(f"log_extra({column!r}, values) was given {len(values)} values for "
                                    f"{completions} completions: give one value per completion, in a single call "
                                    "per scoring")
        return dict(self.columns)
