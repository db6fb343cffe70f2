"""What planning reuses must not change what it builds or chooses: schedules started from the
block passes' table (passes/pipeline.py, `placed`) are those built from scratch, and a model
planned again under another step kind or hardware is judged by that kind and hardware
(planner/judged.py), as a fresh capture of it would be."""
from __future__ import annotations

import dataclasses
import random


from megacompile.cost import get_profile
from megacompile.passes import ScheduleChoice, StepKind, build_schedule
from megacompile.planner.request import PlanRequest
from megacompile.planner.search import make_plan
from tests import models


def _captured(layers=3):
    return models.captured_llama(layers=layers, d=32, rows=2, seq=16)


def _same(a, b) -> bool:
    return (a.nodes, a.values, a.passes) == (b.nodes, b.values, b.passes) and \
        {k: v for k, v in a.facts.items() if k != "pass_seconds"} == \
        {k: v for k, v in b.facts.items() if k != "pass_seconds"}


def test_schedules_from_the_block_passes_table_are_those_built_from_scratch():
    captured = _captured()
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    every, first = frozenset(blocks), frozenset(blocks[:1])
    base = ScheduleChoice(1)
    # Each field the block passes read, and those only later passes read, changed one at a time.
    choices = [base, dataclasses.replace(base, recompute=first), dataclasses.replace(base, recompute=every),
               dataclasses.replace(base, recompute=first, extra_forwards=1),
               dataclasses.replace(base, offload=first), dataclasses.replace(base, offload=first, offload_lag=2),
               dataclasses.replace(base, recompute=first, boundary=first),
               dataclasses.replace(base, recompute=first, boundary=first, offload_lag=2),
               dataclasses.replace(base, micro_batches=2), dataclasses.replace(base, selective=every),
               dataclasses.replace(base, prefetch_depth=0), dataclasses.replace(base, prefetch_depth=2),
               dataclasses.replace(base, resident=frozenset({0})),
               dataclasses.replace(base, serial_optimizer=True)]
    kinds = (StepKind(), StepKind(update=False), StepKind(clip=True, updates="as_gradients_land"))
    asked = [(c, k) for c in choices for k in kinds] * 2
    random.Random(0).shuffle(asked)
    placed: dict = {}
    for choice, kind in asked:
        kept = build_schedule(captured, choice, kind, check=False, placed=placed)
        assert _same(kept, build_schedule(captured, choice, kind, check=False)), (choice, kind)
    assert len(placed) < len(asked)


def test_a_model_planned_again_is_judged_by_the_new_kind_and_hardware():
    again = _captured()
    budget = 2 * sum(st.template.weight_bytes for st in again.stages)
    h100 = get_profile("h100")
    # Links a thousand times slower: another choice at this budget.
    slow = dataclasses.replace(h100, h2d_bw=h100.h2d_bw / 1000, d2h_bw=h100.d2h_bw / 1000)
    chosen = []
    for kind, hardware in ((StepKind(), h100), (StepKind(), slow), (StepKind(update=False), h100)):
        request = PlanRequest(budget, kind, "cpu", hardware, host_bytes=0)
        plan, alone = make_plan(again, request), make_plan(_captured(), request)
        assert plan.program.facts["choice"] == alone.program.facts["choice"], (kind, hardware)
        assert (plan.minimum_budget_bytes, plan.prediction.step_s) == (alone.minimum_budget_bytes,
                                                                      alone.prediction.step_s)
        chosen.append(plan.program.facts["choice"])
    assert chosen[0] != chosen[1]     # the hardware changes the choice at this budget


def test_a_chunk_count_is_traced_once_per_capture():
    """rechunk(n) keeps what it traced: planning the smallest budget, then the user's, tries the same
    counts on the same capture."""
    captured = _captured()
    two = captured.rechunk(2)
    assert two is captured.rechunk(2) and two is not captured.rechunk(4)
    assert any(st.template.chunked for st in two.stages) and two.rechunk is None
