"""`on_nonfinite="skip"` with a limit: a run whose every step has an inf or NaN loss or gradient
would skip forever, updating nothing. After `limit` skipped optimizer steps in a row the run stops
with NonFiniteError; the last checkpoint still holds the last step that updated (a skipped step
changes no weight, moment or counter). The engine keeps one (compile(..., max_consecutive_skips=N));
`megacompile train` keeps its own, from run.yaml's max_consecutive_skips.
"""
from __future__ import annotations

from ..errors import NonFiniteError

RUN_YAML = "max_consecutive_skips sets how many skipped steps in a row stop the run (null: never)"


class SkipStreak:
    """Counts the optimizer steps skipped in a row; `limit` None never stops. `setting`: how the
    user sets the limit, for the error."""

    def __init__(self, limit: int | None, setting: str = RUN_YAML):
        self.limit, self.count, self.setting = limit, 0, setting

    def updated(self) -> None:
        self.count = 0

    def skipped(self, record) -> None:
        self.count += 1
        if self.limit is not None and self.count >= self.limit:
            raise NonFiniteError(
                f"{self.count} optimizer steps in a row were skipped, the last (step {record.step}) because "
                f"{record.reason}: nothing has been updated since step {record.step - 1}, and a run that only "
                "skips never recovers; lower lr, raise warmup, check the data or the model's numerics (compute_dtype "
                f"float32), and resume from the last checkpoint; {self.setting}")
