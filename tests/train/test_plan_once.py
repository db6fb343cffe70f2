"""`megacompile train` with global_batch captures and plans each input shape once before its
first step: the budget's smallest plan, the micro-batch sizes it chooses among and the engine's
first step share their captures and the chosen plan (train/model.py build)."""
from __future__ import annotations

import pytest

import megacompile.capture as capture_room
import megacompile.planner.search as search
from megacompile.engine import Engine
from megacompile.train import load, run
from tests.train import files

RUN = dict(model="bundled", data="bundled", bundled_model=dict(dim=32, layers=2, heads=2, kv_heads=1, ffn=64),
           device="cpu", seq=16, steps=1, budget_fraction=8)


@pytest.mark.parametrize("split, shapes", [
    # global_batch 4: micro-batches of 4, 2 and 1 rows of 16 tokens are planned, one is chosen
    ({"global_batch": 4}, {(4, 16), (2, 16), (1, 16)}),
    # batch and grad_accum given: one shape, for the budget's smallest plan and the engine
    ({"batch": 2, "grad_accum": 2}, {(2, 16)}),
])
def test_each_shape_is_captured_and_planned_once_before_the_first_step(tmp_path, monkeypatch, split, shapes):
    counts = {"captures": [], "plans": 0}
    at_first_step = {}

    trace_top = capture_room.trace_top

    def counted_trace(model, stack, fakes, args, kwargs, *rest, **kw):
        shape = next(tuple(t.shape) for t in kwargs.values())
        counts["captures"].append(shape)
        return trace_top(model, stack, fakes, args, kwargs, *rest, **kw)

    class CountedPlan(search.Plan):
        def __init__(self, *args, **kwargs):
            counts["plans"] += 1
            super().__init__(*args, **kwargs)

    step = Engine.weighted_step

    def first_step_counted(self, *args, **kwargs):
        at_first_step.setdefault("captures", list(counts["captures"]))
        at_first_step.setdefault("plans", counts["plans"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(capture_room, "trace_top", counted_trace)
    monkeypatch.setattr(search, "Plan", CountedPlan)
    monkeypatch.setattr(Engine, "weighted_step", first_step_counted)
    run(load(files.run_yaml(str(tmp_path / "run.yaml"), **RUN, **split, run_dir=str(tmp_path / "run"))))
    assert set(at_first_step["captures"]) == shapes
    assert len(at_first_step["captures"]) == len(shapes), at_first_step
    assert at_first_step["plans"] == len(shapes), at_first_step
