"""What running a plan measured: kept beside the plan, which stays as the planner solved it.

The engine owns one record per plan it runs and writes it after each run; the plan's reports
(its summary, plan.json, the memory picture, measured_memory) read it when handed one, or through
the link an engine's copy of the plan carries (Plan.with_measured).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class MeasuredRun:
    # The runtime's record of the last step its backend ran (runtime/timeline.py), whichever plan
    # that was: it holds this plan's step when its `program` is this plan's.
    timeline: Any = None
    peak_bytes: int | None = None     # the device ledger's peak in this plan's last run; None: not run yet

    def memory(self, program) -> list | None:
        """The last step's device bytes per node of `program` (runtime MemorySample: live after,
        peak during), or None when the timeline holds no step of it."""
        t = self.timeline
        if t is None or t.program is not program or len(t.memory) != len(program.nodes):
            return None
        return list(t.memory)
