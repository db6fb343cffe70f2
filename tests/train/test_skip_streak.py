"""on_nonfinite: skip does not skip forever: after max_consecutive_skips skipped optimizer steps
in a row the run stops with NonFiniteError, naming the last reason and the key; a skip between
updates only restarts the count."""
from __future__ import annotations

import json

import pytest

from megacompile.engine.engine import Engine
from megacompile.engine.step import StepRecord
from megacompile.errors import NonFiniteError
from megacompile.train import load, log, run
from megacompile.train.skip_streak import SkipStreak

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "log_every=1"]


def _non_finite_at(monkeypatch, poisoned, loss: float = float("nan"), what: str = "loss") -> list:
    """Engine.weighted_step as the engine skips a step whose loss is NaN (`what`: gradient, a step whose gradient
    is, its `loss` finite), on the calls `poisoned(call)` picks; more than 40 calls fail the test (a run that
    never stops)."""
    step, calls = Engine.weighted_step, []

    def maybe_poisoned(self, *args, **kwargs):
        calls.append(1)
        assert len(calls) <= 40, "the run kept skipping and never stopped"
        if not poisoned(len(calls)):
            return step(self, *args, **kwargs)
        self.state.step_skipped(0)
        # As engine/step.py's _skip records it: a skipped step's record has no token count.
        self.last_step = StepRecord(self.steps_done + 1, loss, 0, True, skipped=what, reason=f"the {what} is nan")
        return loss
    monkeypatch.setattr(Engine, "weighted_step", maybe_poisoned)
    return calls


def test_every_step_non_finite_stops_after_the_limit(tmp_path, monkeypatch):
    _non_finite_at(monkeypatch, lambda call: True)
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row were skipped, the last \(step 1\) because "
                                             r"the loss is nan.*max_consecutive_skips"):
        run(load(None, ["steps=100", "max_consecutive_skips=3", f"run_dir={tmp_path / 'run'}", *TINY]))
    assert [r["skipped"] for r in log.read(str(tmp_path / "run" / "log.csv"))] == ["loss"] * 3


def test_skips_between_updates_restart_the_count(tmp_path, monkeypatch):
    # two skipped for their gradient (a finite loss), one updated, ...
    _non_finite_at(monkeypatch, lambda call: call % 3 != 0, loss=9.0, what="gradient")
    result = run(load(None, ["steps=3", "max_consecutive_skips=3", f"run_dir={tmp_path / 'run'}", *TINY]))
    assert result["steps"] == 3 and result["skipped_steps"] == 6
    # log.csv: each skipped try under the number of the step it tried, before the row of the step that updated,
    # which are one per step; the logs made from it hold those alone
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [(r["step"], r["skipped"]) for r in rows] == [(str(n), why) for n in (1, 2, 3)
                                                         for why in ("gradient", "gradient", "")]
    with open(tmp_path / "run" / "trainer_log.jsonl") as f:
        assert [json.loads(line)["current_steps"] for line in f] == [1, 2, 3]
    with open(tmp_path / "run" / "trainer_state.json") as f:
        state = json.load(f)
    updated = [float(r["loss"]) for r in rows if not r["skipped"]]
    assert [(r["step"], r["loss"]) for r in state["log_history"][:-1]] == [(n, round(x, 4)) for n, x in
                                                                           zip((1, 2, 3), updated)]
    assert state["log_history"][-1]["train_loss"] == pytest.approx(sum(updated) / 3, rel=1e-12)


def test_the_streak_alone():
    streak, record = SkipStreak(2), StepRecord(7, float("inf"), 0, False, skipped="gradient", reason="grads nan")
    streak.skipped(record)
    streak.updated()
    streak.skipped(record)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        streak.skipped(record)
    never = SkipStreak(None)
    for _ in range(1000):
        never.skipped(record)
