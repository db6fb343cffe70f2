"""A run whose loss turns NaN and stays so is stopped by max_consecutive_skips with NonFiniteError
naming the checkpoint it goes on from: the last one saved before the skips (a skipped step saves
nothing), which the same command resumes, once the cause is gone, to the log of a run that never
met a NaN."""
from __future__ import annotations

import os

import pytest

from megacompile.engine.engine import Engine
from megacompile.engine.step import StepRecord
from megacompile.errors import NonFiniteError
from megacompile.io import checkpoint
from megacompile.train import load, run
from tests.train import files

TINY = dict(bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu", batch=1, seq=16,
            steps=6, lr=3e-3, warmup=1, save_every=2, keep_last=3, resume="auto", log_every=1,
            max_consecutive_skips=3)



def _nan_from_call(monkeypatch, first: int) -> None:
    """Engine.weighted_step from its `first`-th call on as the engine skips a step whose loss is NaN."""
    step, calls = Engine.weighted_step, []

    def poisoned(self, *args, **kwargs):
        calls.append(1)
        assert len(calls) <= 20, "the run kept skipping and never stopped"
        if len(calls) < first:
            return step(self, *args, **kwargs)
        self.state.step_skipped(0)
        self.last_step = StepRecord(self.steps_done + 1, float("nan"), 0, True, skipped="loss",
                                    reason="the loss is nan")
        return float("nan")
    monkeypatch.setattr(Engine, "weighted_step", poisoned)


def test_the_limit_names_the_last_good_checkpoint_and_the_same_command_resumes_from_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    whole = files.run_yaml(str(tmp_path / "whole.yaml"), run_dir="whole", **TINY)
    run(load(whole, []))
    config = files.run_yaml(str(tmp_path / "nan.yaml"), run_dir="nan", **TINY)
    folder = tmp_path / "nan" / "checkpoints"

    _nan_from_call(monkeypatch, 4)           # steps 1-3 update, then every step is NaN
    with pytest.raises(NonFiniteError) as stopped:
        run(load(config, []))
    said = str(stopped.value)
    assert said.startswith("3 optimizer steps in a row were skipped, the last (step 4) because the loss is nan")
    assert said.endswith(f"the run stopped after step 3; the same command goes on from its last checkpoint, "
                         f"{folder / 'step-000002'} (step 2), training step 3 again"), said
    assert os.listdir(folder) == ["step-000002"]
    assert [(r["step"], r["skipped"]) for r in files.log_rows("nan")][2:] == [("3", ""), ("4", "loss"), ("4", "loss"),
                                                                      ("4", "loss")]
    ours = checkpoint.verified_manifest(str(folder / "step-000002"))["files"]
    assert ours == checkpoint.verified_manifest(str(tmp_path / "whole" / "checkpoints" / "step-000002"))["files"]

    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert run(load(config, []))["steps"] == 6
    assert files.log_rows("nan") == files.log_rows("whole")
