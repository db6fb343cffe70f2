"""The compute floor (megacompile/planner/floor.py) lets the solver skip a family without building
its schedule: it must never be above what it bounds, the whole stack's prediction and the
short-stack estimate, for any kind of choice, one micro-batch or several run layer-major."""
from __future__ import annotations

import dataclasses

import pytest

from megacompile.cost import get_profile, predict
from megacompile.passes import StepKind, build_schedule
from megacompile.passes.lower import lower
from megacompile.passes.selective import with_selective
from megacompile.planner.floor import compute_floor
from megacompile.planner.search import judges, search_space
from megacompile.planner.solve import candidates
from tests import models


@pytest.mark.slow     # 13 s of schedules built and predicted
def test_the_floor_is_under_every_prediction_and_estimate():
    captured = models.captured_llama(layers=10, d=32, rows=8, seq=32)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    hardware = get_profile("h100")

    def whole(choice):
        return build_schedule(captured, choice, check=False)
    peak_of, seconds_of = judges(captured, blocks, hardware, whole, lower, StepKind())
    floor_of = compute_floor(captured, hardware)
    # Every family, resident weights included (judged whole), with one and three micro-batches.
    space = search_space(captured, blocks, hardware, device_room=2 ** 40)
    assert any(len(f.resident) > 1 for f in space)
    checked, tight = 0, 0
    for family in space[::3]:
        for choice in candidates(blocks, family)[::4]:
            for k in (1, 3):
                c = dataclasses.replace(choice, micro_batches=k)
                exact = predict(whole(c), with_selective(captured, c.selective), hardware).step_s
                floor = floor_of(c)
                assert floor <= exact and floor <= seconds_of(c), (c, floor, exact, seconds_of(c))
                checked += 1
                tight += floor >= 0.5 * exact
    assert checked > 100
    assert tight > checked // 2     # a floor far under the step would prune nothing
