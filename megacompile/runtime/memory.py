"""Device memory under an enforced budget.

Every device tensor the runtime makes is held here under a name (a schedule value, or a graph
node while a stage runs) and dropped when the schedule or the stage's liveness says so. The
count follows ir/ledger.py, the simulator's rule, so the measured peak is comparable with the
predicted one; going over the budget raises before the step can continue.
"""
from __future__ import annotations

from typing import Any, Hashable


from ..errors import BudgetExceededError
from ..ir.ledger import StorageLedger
from ..ir.printer import fmt_bytes
from ..ir.stage_program import real_storage_key, tensors_of


class DeviceMemory:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.ledger = StorageLedger()

    def hold(self, holder: Hashable, value: Any, what: str = "") -> None:
        for t in tensors_of(value):
            nbytes = t.untyped_storage().nbytes()
            if nbytes == 0:
                continue
            self.ledger.hold(holder, real_storage_key(t), nbytes)
            if self.ledger.live_bytes > self.budget_bytes:
                raise BudgetExceededError(
                    f"device memory would reach {fmt_bytes(self.ledger.live_bytes)} with {what or holder}, "
                    f"over the budget of {fmt_bytes(self.budget_bytes)}; the plan predicted less, so "
                    "this is a planner bug: report it with the plan dump (engine.plan.dump(dir))")

    def drop(self, holder: Hashable, value: Any) -> None:
        for t in tensors_of(value):
            if t.untyped_storage().nbytes():
                self.ledger.drop(holder, real_storage_key(t))

    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    def reset_peak(self) -> None:
        self.ledger.reset_peak()


