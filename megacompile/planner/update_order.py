"""The order of the host updates started as their gradients land (compile(..., updates="as_gradients_land")).

Taken strictly as they land, the updates run in reverse forward order. When the host's AdamW is
slower than the backward, the backlog at the end of the backward is then the embedding and the
first blocks, which the next forward reads first: the forward waits for all of it, and the host
idles while the forward runs. Moving the last updates to the end of the backward, in forward
order, leaves the backlog to the blocks the forward reads last, worked through beside it. Too
many moved and the host idles during the backward instead, so the planner plays each count on
the cost model (a play costs about a millisecond) and keeps the fastest.

The order is the plan's: the runtime runs the updates on the host stream in program order, so
what a non-finite gradient leaves applied depends on the plan, never on timing.
"""
from __future__ import annotations

from ..capture import CapturedModel
from ..cost.hardware import HardwareProfile
from ..cost.predict import predict
from ..ir.program import Op, Program
from ..passes.optimizer import updates_in_forward_order


def fastest_update_order(program: Program, captured: CapturedModel, hardware: HardwareProfile,
                         disk_per_param: float = 0.0) -> Program:
    """`program` with the number of its last updates moved into forward order that predicts the
    shortest step (ties to the fewest moved); `program` itself where none helps."""
    steps = sum(n.op is Op.OPTIMIZER_STEP for n in program.nodes)
    if steps < 2:
        return program
    landing_s = predict(program, captured, hardware, disk_per_param).step_s
    best, best_s = program, landing_s
    for tail in range(2, steps + 1):
        moved = updates_in_forward_order(program, tail)
        step_s = predict(moved, captured, hardware, disk_per_param).step_s
        if step_s < best_s * (1 - 1e-9):
            best, best_s = moved, step_s
    if best is not program:
        best.facts["step_s_strictly_as_gradients_land"] = landing_s
    return best
