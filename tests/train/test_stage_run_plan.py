"""`megacompile plan --run` of a post-training run (dpo, kto, rm, grpo) plans the training step the
run's engine then plans: the gradients' norm taken every step (clipped at max_grad_norm, or at
null for the log) and the accumulation's gradient buffers of grad_accum micro-batches, as the
run's plan/plan.json holds them (the cpu backend, where both are made here)."""
from __future__ import annotations

import json

import pytest

import megacompile.planner
from megacompile.cli import main
from tests.posttrain import stage_files
from tests.train import files
from tests.train.test_run_plan import TIMED

# What the run's objective adds to the step it trains (posttrain/: the reference's log-probabilities
# and the loss over them as inputs and values of its graph), which the stage's plan, of the model's
# rows, leaves out: a few bytes over the link, a few small tensors; grpo's per-token inputs move
# the peak too.
OBJECTIVE = {"arena_tensor_count", "arena_tensors", "h2d_bytes_per_step", "values", "schedule"}
PEAK = {"device_peak_bytes", "device_arena_bytes", "arena_fragmentation_bytes", "arena_fragmentation_share"}


def _run(work: dict, stage: str, folder: str, max_grad_norm) -> dict:
    more = dict(steps=1, grad_accum=2, max_grad_norm=max_grad_norm)
    if stage == "grpo":
        return stage_files.grpo(work, folder, **more)
    return stage_files.dpo(work, folder, **more) | {"stage": stage}


@pytest.mark.parametrize("stage, max_grad_norm", [
    ("dpo", 1.0), pytest.param("dpo", None, marks=pytest.mark.slow), pytest.param("kto", 1.0, marks=pytest.mark.slow),
    pytest.param("rm", 1.0, marks=pytest.mark.slow), pytest.param("grpo", 1.0, marks=pytest.mark.slow)])
def test_a_post_training_run_plans_the_clip_and_accumulation_its_engine_plans(tmp_path, capsys, monkeypatch, stage,
                                                                                max_grad_norm):
    work = stage_files.workspace(tmp_path)
    settings = _run(work, stage, str(tmp_path / "run"), max_grad_norm)
    path = files.run_yaml(str(tmp_path / "r.yaml"), **settings)      # null: the norm is still taken, for the log
    planned = []
    plan_stage = megacompile.planner.plan_stage
    monkeypatch.setattr(megacompile.planner, "plan_stage", lambda *a, **k: planned.append(plan_stage(*a, **k))
                        or planned[-1])
    assert main(["plan", "--run", path, "--hardware", "cpu", "--json"]) == 0
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    step = planned[0].train.to_json()
    # The run's step: its gradients' norm after the backward, at the host, before the updates.
    ops = [[op["op"] for op in where["schedule"]] for where in (step, ran)]
    assert "clip_grads" in ops[1]
    assert ops[0] == ops[1]
    # Its host state: two micro-batches' gradients summed (an fp32 sum and a landing buffer beside).
    assert step["grad_accum"] == ran["grad_accum"] == 2
    left_out = TIMED | OBJECTIVE | (PEAK if stage == "grpo" else set())
    shared = [k for k in ran if k in step and k not in left_out]
    assert len(shared) > 40
    assert {k: step[k] for k in shared} == {k: ran[k] for k in shared}
