"""A capture and plan made before the engine (engine/prepared.py), handed to it with adopt(): the
engine runs them at its first step with those inputs instead of tracing and planning again; a
request of its own that differs (a dump folder) plans again from the same capture, and inputs of
other shapes are captured anew. Either way the step is the one an engine that made its own plan
takes."""
from __future__ import annotations

import pytest
import torch

import megacompile
import megacompile.capture as capture_room
import megacompile.planner.search as search
from megacompile.engine import prepare
from megacompile.optim import AdamW
from megacompile.settings import Settings
from tests import models

SETTINGS = dict(hbm_budget=1.0, device="cpu", compute_dtype=torch.float32)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=32, layers=2, heads=4)


def _inputs(rows: int = 2) -> dict:
    ids = models.batch(96, rows, 16)
    return {"idx": ids, "targets": ids}


@pytest.fixture
def counts(monkeypatch):
    """Traces and plans made from here on."""
    made = {"traces": 0, "plans": 0}
    trace_top = capture_room.trace_top

    def counted_trace(*args, **kwargs):
        made["traces"] += 1
        return trace_top(*args, **kwargs)

    class CountedPlan(search.Plan):
        def __init__(self, *args, **kwargs):
            made["plans"] += 1
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(capture_room, "trace_top", counted_trace)
    monkeypatch.setattr(search, "Plan", CountedPlan)
    return made


def _prepared(model, inputs: dict):
    meta = {k: v.to("meta") for k, v in inputs.items()}
    return prepare(model, meta, Settings(**SETTINGS), clip=AdamW().max_grad_norm is not None)


def _first_step(engine, inputs: dict) -> tuple[float, dict]:
    loss = engine.step(**inputs)
    return loss, {k: v.clone() for k, v in engine.state_dict().items()}


def test_an_adopted_plan_runs_without_tracing_or_planning_and_trains_as_a_fresh_one(counts):
    inputs = _inputs()
    fresh = megacompile.compile(_model(), **SETTINGS)
    expected = _first_step(fresh, inputs)
    fresh.close()
    model = _model()
    prepared = _prepared(model, inputs)
    engine = megacompile.compile(model, **SETTINGS)
    before = dict(counts)
    engine.adopt(prepared)
    plan = engine.prepare(**inputs)
    assert counts == before                   # the capture and the plan made above, taken
    assert plan.program is prepared.plan.program
    loss, weights = _first_step(engine, inputs)
    engine.close()
    assert loss == expected[0]
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[1][name], rtol=0, atol=0)


def test_a_request_of_its_own_plans_again_from_the_adopted_capture(counts, tmp_path):
    inputs = _inputs()
    model = _model()
    prepared = _prepared(model, inputs)
    engine = megacompile.compile(model, **SETTINGS, dump_dir=str(tmp_path / "dump"))
    before = dict(counts)
    engine.adopt(prepared)
    plan = engine.prepare(**inputs)
    engine.close()
    assert counts["traces"] == before["traces"] and counts["plans"] > before["plans"]
    assert plan.captured is prepared.captured and (tmp_path / "dump").is_dir()


def test_inputs_of_other_shapes_are_captured_anew(counts):
    model = _model()
    prepared = _prepared(model, _inputs(rows=2))
    engine = megacompile.compile(model, **SETTINGS)
    engine.adopt(prepared)
    before = dict(counts)
    plan = engine.prepare(**_inputs(rows=1))
    engine.close()
    assert counts["traces"] > before["traces"] and plan.captured is not prepared.captured


def test_another_modules_prepared_capture_is_not_taken(counts):
    """A capture of another module with the same shapes would run its graph over this engine's
    weights: the engine captures its own."""
    inputs = _inputs()
    prepared = _prepared(_model(), inputs)
    engine = megacompile.compile(_model(), **SETTINGS)
    engine.adopt(prepared)
    before = dict(counts)
    plan = engine.prepare(**inputs)
    engine.close()
    assert counts["traces"] > before["traces"] and plan.captured is not prepared.captured
