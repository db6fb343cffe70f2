"""A floor under a choice's predicted step, from its compute nodes alone, without building it.

The cost model (cost/predict.py) plays a schedule on its streams; the compute stream runs every
compute node, each after the profile's per-node issue overhead, and the copy of the model inputs,
and only ever waits on top of that. So the sum of those seconds is a floor under the predicted
step, whatever the transfers do. The nodes are known from the choice: every stage's forward and
(where it trains) backward, a recompute before the backward of each recomputed block, all once
per micro-batch of a layer-major program. The short-stack estimate (planner/shorten.py) stays
above it too: a cut block adds at least the busiest stream's, so the compute stream's, seconds.

The solver asks it before judging a family's fastest choice against a bar (solve.py): a family
whose floor is above the bar is one whose prediction would have been too, and is skipped without
a schedule built (a layer-major one on the whole stack takes 30-50 ms).
"""
from __future__ import annotations

from typing import Callable

from ..capture import CapturedModel
from ..cost import HardwareProfile
from ..cost.estimate import graph_cost
from ..passes.pipeline import ScheduleChoice


def compute_floor(captured: CapturedModel, hardware: HardwareProfile) -> Callable[[ScheduleChoice], float]:
    """choice -> seconds that no prediction of that choice's step undercuts."""
    if not captured.train:
        return lambda choice: 0.0
    overhead, dtype = hardware.node_overhead_s, captured.compute_dtype
    inputs_s = overhead + sum(m.nbytes for m in captured.inputs) / hardware.h2d_bw

    def seconds(graph) -> float:
        return overhead + graph_cost(graph, hardware, dtype).seconds

    # Per stage, for its template and for the variant it runs when selective (with_selective):
    # (forward, backward or 0 where no backward runs, whether one runs).
    per_stage = []
    for st in captured.stages:
        row = []
        for t in (st.template, st.template.selective or st.template):
            trains = bool(t.grad_params or t.grad_acts)
            row.append((seconds(t.forward), seconds(t.backward) if trains else 0.0, trains))
        per_stage.append(row)

    def floor(choice: ScheduleChoice) -> float:
        total = inputs_s
        for s, row in enumerate(per_stage):
            forward, backward, trains = row[s in choice.selective]
            total += forward + backward
            if trains and s in choice.recompute:
                total += (1 + choice.extra_forwards) * forward
        return choice.micro_batches * total
    return floor

