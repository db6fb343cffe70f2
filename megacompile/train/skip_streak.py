"""`on_nonfinite: skip` with a limit in `megacompile train`: after run.yaml's
`max_consecutive_skips` skipped optimizer steps in a row the run stops with NonFiniteError. The
count is the engine's own kind (engine/skip_streak.py); the loops keep theirs, from run.yaml."""
from __future__ import annotations

from ..engine import SkipStreak

__all__ = ["SkipStreak"]
