"""A plan is frozen once solved; what a run measures (the device peak, the runtime's record of the
step) is the engine's MeasuredRun, kept beside the plan (planner/measured.py), and the plan an
engine runs reads it: plan.measured_peak_bytes, measured_memory(), the summary and plan.json."""
from __future__ import annotations

import dataclasses

import pytest

from megacompile.planner.measured import MeasuredRun
from tests import models


@pytest.fixture(scope="module")
def engine(planned_engine):
    return planned_engine


def test_a_solved_plan_is_frozen(engine):
    plan = engine.plan
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.budget_bytes = 1
    with pytest.raises(AttributeError):
        plan.measured_peak_bytes = 1


def test_a_revised_plan_keeps_the_schedule_and_its_curve(engine):
    plan = engine.plan
    given = plan.revised(given_budget_bytes=plan.budget_bytes // 2, minimum_over_chunks=True)
    assert given is not plan and given.program is plan.program and given.curve is plan.curve
    assert given.given_budget_bytes == plan.budget_bytes // 2 and plan.given_budget_bytes is None
    assert given.measured is plan.measured         # still the engine's record
    with pytest.raises(TypeError, match="program"):
        plan.revised(program=plan.program)
    with pytest.raises(TypeError, match="curve"):
        plan.revised(curve=plan.curve)


def test_the_engines_plan_reads_what_its_step_measured(engine):
    plan = engine.plan
    ids = models.batch(96, 2, 16)
    engine.step(idx=ids, targets=ids)
    assert plan.measured_peak_bytes == engine.last_step.device_peak_bytes == engine.memory_stats()["device_peak_bytes"]
    assert plan.measured_peak_bytes is not None and plan.timeline is engine.timeline
    assert "measured in the last run" in plan.summary()
    assert plan.to_json()["measured_device_peak_bytes"] == plan.measured_peak_bytes
    assert [m.peak for m in plan.measured_memory()] == plan.curve.peak_during


def test_a_plan_no_engine_runs_reads_a_record_given_to_it(engine):
    ids = models.batch(96, 2, 16)
    engine.step(idx=ids, targets=ids)
    alone = engine.plan.revised(measured=None)
    assert alone.measured_peak_bytes is None and alone.measured_memory() is None
    assert "not run yet" in alone.summary()
    record = MeasuredRun(engine.timeline, 1000)
    assert alone.measured_memory(record) == engine.plan.measured_memory()
    assert "1000 B measured in the last run" in alone.summary(record)
    assert alone.measured_memory(MeasuredRun()) is None
