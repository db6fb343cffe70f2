"""on_nonfinite: skip does not skip forever: after max_consecutive_skips skipped optimizer steps
in a row the run stops with NonFiniteError, naming the last reason and the key; a skip between
updates only restarts the count."""
from __future__ import annotations

import pytest

from megacompile.engine.engine import Engine
from megacompile.engine.step import StepRecord
from megacompile.errors import NonFiniteError
from megacompile.train import load, log, run
from megacompile.train.skip_streak import SkipStreak

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "log_every=1"]


def _non_finite_at(monkeypatch, poisoned) -> list:
    """Engine.weighted_step as the engine skips a step whose loss is NaN, on the calls `poisoned(call)` picks;
    more than 40 calls fail the test (a run that never stops)."""
    step, calls = Engine.weighted_step, []

    def maybe_poisoned(self, *args, **kwargs):
        calls.append(1)
        assert len(calls) <= 40, "the run kept skipping and never stopped"
        if not poisoned(len(calls)):
            return step(self, *args, **kwargs)
        self.state.step_skipped(0)
        # As engine/step.py's _skip records it: a skipped step's record has no token count.
        self.last_step = StepRecord(self.steps_done + 1, float("nan"), 0, True, skipped="loss",
                                    reason="the loss is nan")
        return float("nan")
    monkeypatch.setattr(Engine, "weighted_step", maybe_poisoned)
    return calls


def test_every_step_non_finite_stops_after_the_limit(tmp_path, monkeypatch):
    _non_finite_at(monkeypatch, lambda call: True)
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row were skipped, the last \(step 1\) because "
                                             r"the loss is nan.*max_consecutive_skips"):
        run(load(None, ["steps=100", "max_consecutive_skips=3", f"run_dir={tmp_path / 'run'}", *TINY]))
    assert [r["skipped"] for r in log.read(str(tmp_path / "run" / "log.csv"))] == ["loss"] * 3


def test_skips_between_updates_restart_the_count(tmp_path, monkeypatch):
    _non_finite_at(monkeypatch, lambda call: call % 3 != 0)         # two skipped, one updated, ...
    result = run(load(None, ["steps=3", "max_consecutive_skips=3", f"run_dir={tmp_path / 'run'}", *TINY]))
    assert result["steps"] == 3 and result["skipped_steps"] == 6


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
