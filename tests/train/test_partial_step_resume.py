"""A run with updates: as_gradients_land whose step fails after its first update stops with
PartialStepError naming the checkpoint it goes on from, and the same command resumes from it to the
log of a run that never failed."""
from __future__ import annotations

import pytest

from megacompile.engine.engine import Engine
from megacompile.errors import PartialStepError
from megacompile.train import load, run
from tests.train import files

TINY = dict(bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu", batch=1, seq=16,
            steps=4, lr=3e-3, warmup=1, save_every=2, resume="auto", log_every=1, max_grad_norm=None,
            updates="as_gradients_land")


def test_a_step_partly_applied_stops_the_run_which_the_same_command_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(load(files.run_yaml(str(tmp_path / "whole.yaml"), run_dir="whole", **TINY), []))
    config = files.run_yaml(str(tmp_path / "cut.yaml"), run_dir="cut", **TINY)
    step, calls = Engine.weighted_step, []

    def failing(self, *args, **kwargs):     # the 4th step fails after its first update ran
        calls.append(1)
        loss = step(self, *args, **kwargs)
        if len(calls) == 4:
            self.state.step_partly_applied("step 4 failed (RuntimeError: injected) after 1 of its 3 owners' host "
                                           "updates had run")
            raise PartialStepError(f"{self.state.partial_step}; load_checkpoint(path) to go on")
        return loss
    monkeypatch.setattr(Engine, "weighted_step", failing)
    with pytest.raises(PartialStepError) as stopped:
        run(load(config, []))
    said = str(stopped.value)
    assert said.startswith("step 4 failed (RuntimeError: injected)")
    assert "the same command goes on from its last checkpoint" in said and "step-000002" in said, said
    monkeypatch.setattr(Engine, "weighted_step", step)
    run(load(config, []))
    whole, cut = files.log_rows("whole"), files.log_rows("cut")
    assert [r["loss"] for r in cut if r["step"] in ("3", "4")][-2:] == [r["loss"] for r in whole][2:4]
