"""The order of the host updates started as their gradients land (compile(..., updates="as_gradients_land")).

Taken strictly as they land, the updates run in reverse forward order. When the host's AdamW is
slower than the backward, the backlog at the end of the backward is then the embedding and the
first blocks, which the next forward reads first: the forward waits for all of it, and the host
idles while the forward runs. Moving the last updates to the end of the backward, in forward
order, leaves the backlog to the blocks the forward reads last, worked through beside it. Too
many moved and the host idles during the backward instead, so the planner plays each count on
the cost model (a play costs about a millisecond at 3B) and keeps the fastest; the solver times
its candidates so too, so the schedule it keeps is the fastest with its updates so ordered.

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
    return _fastest(program, captured, hardware, disk_per_param)[0]


def fastest_step_s(program: Program, captured: CapturedModel, hardware: HardwareProfile,
                   disk_per_param: float = 0.0) -> float:
    """The predicted step of fastest_update_order(program, ...): how the solver times a candidate."""
    return _fastest(program, captured, hardware, disk_per_param)[1]


# Up to this many updates every count is played; past it, every COARSE-th, then each count around
# the fastest of those (a 118B model's 90 owners: about 30 plays, not 90).
EVERY = 48
COARSE = 8


def _fastest(program: Program, captured: CapturedModel, hardware: HardwareProfile,
             disk_per_param: float) -> tuple[Program, float]:
    steps = sum(n.op is Op.OPTIMIZER_STEP for n in program.nodes)
    landing_s = predict(program, captured, hardware, disk_per_param).step_s
    played: dict[int, tuple[float, Program]] = {0: (landing_s, program)}

    def play(tail: int) -> None:
        if tail not in played:
            moved = updates_in_forward_order(program, tail)
            played[tail] = predict(moved, captured, hardware, disk_per_param).step_s, moved
    counts = range(2, steps + 1)
    if steps <= EVERY:
        for tail in counts:
            play(tail)
    else:
        for tail in counts[::COARSE]:
            play(tail)
        coarse = min(played, key=lambda t: (played[t][0], t))
        for tail in range(max(2, coarse - COARSE + 1), min(steps, coarse + COARSE - 1) + 1):
            play(tail)
    step_s, chosen = played[min(played, key=lambda t: (played[t][0], t))]
    if step_s >= landing_s * (1 - 1e-9):
        return program, landing_s
    chosen.facts["step_s_strictly_as_gradients_land"] = landing_s
    return chosen, step_s
