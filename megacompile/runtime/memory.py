"""Device memory under an enforced budget.

Every device tensor the runtime makes is held here under a name (a schedule value, or a graph
node while a stage runs) and dropped when the schedule or the stage's liveness says so. The
count follows ir/ledger.py, the simulator's rule, so the measured peak is comparable with the
predicted one; going over the budget raises before the step can continue.
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx as fx

from ..errors import BudgetExceededError
from ..ir.ledger import StorageLedger
from ..ir.printer import fmt_bytes
from ..ir.stage_program import tensors_of


def _tensors(value: Any):
    # Most values are one tensor: no pytree walk for them (this runs after every op).
    if isinstance(value, torch.Tensor):
        return (value,)
    return () if value is None else tensors_of(value)


class DeviceMemory:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.ledger = StorageLedger()
        # With a device arena (runtime/arena.py) serving the step: the device storages held this
        # step that are not in it (a graph's constants aside, made once), and where they came from.
        self.arena = None
        self.outside: list[str] = []

    def hold(self, holder: Hashable, value: Any, what: str = "") -> None:
        """`what` names where it happens (a stage graph: the op's node is the holder)."""
        for t in _tensors(value):
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            new = self.ledger.hold(holder, (t.device, storage.data_ptr()), nbytes)
            if new and self.arena is not None and not self.arena.holds(t) and t.device.type == self.arena.device_type \
                    and not (isinstance(holder, fx.Node) and holder.op == "get_attr"):
                self.outside.append(f"{what}: {holder.name}" if isinstance(holder, fx.Node) else str(what or holder))
            if self.ledger.live_bytes > self.budget_bytes:
                where = f"{what}: {holder.name}" if isinstance(holder, fx.Node) else (what or holder)
                raise BudgetExceededError(
                    f"device memory would reach {fmt_bytes(self.ledger.live_bytes)} with {where}, "
                    f"over the budget of {fmt_bytes(self.budget_bytes)}; the plan predicted less, so "
                    "this is a planner bug: report it with the plan dump (engine.plan.dump(dir))")

    def drop(self, holder: Hashable, value: Any) -> None:
        for t in _tensors(value):
            storage = t.untyped_storage()
            if storage.nbytes():
                self.ledger.drop(holder, (t.device, storage.data_ptr()))

    @property
    def live_bytes(self) -> int:
        return self.ledger.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self.ledger.peak_bytes

    def reset_peak(self) -> None:
        self.ledger.reset_peak()


