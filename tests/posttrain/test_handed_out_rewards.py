"""Stages dpo, kto and rm log the rewards of the policy each step starts from, out of the step's own
training forward (stages/handed_out.py): no forward-only pass of the rows runs for them. The logged
columns are those a forward-only pass of the same rows before each micro-batch gives, the way
the stages computed them before, and the engine's forward calls inside a step drop to what the
loss needs (kto's KL rows; none for dpo and rm)."""
from __future__ import annotations

import math

import pytest
import torch

from megacompile.engine import Engine
from megacompile.posttrain import preference_metrics
from megacompile.train import load, log, run
from megacompile.train.stages.dpo import DPOStage
from megacompile.train.stages.kto import KTOStage
from megacompile.train.stages.rm import RMStage
from tests.posttrain import stage_files
from tests.train import files

TRAINING_ONLY = ("ref_logps", "margin", "desirable", "kl")      # the loss's inputs; a forward-only pass takes none
STAGES = {"dpo": DPOStage, "kto": KTOStage, "rm": RMStage}
ACCUM, STEPS, BETA = 2, 3, 0.5


def _run(tmp_path, monkeypatch, stage: str) -> tuple[list[dict], list[tuple[dict, torch.Tensor]], list[int]]:
    """The run's log rows; each micro-batch's step inputs with the forward-only values of its rows
    under the masters the step starts from (today's logged values, computed the old way here); the
    stage's engine forward calls inside each of its steps."""
    work = stage_files.workspace(tmp_path)
    settings = {k: v for k, v in stage_files.dpo(work, str(tmp_path / "run")).items()
                if k not in ("eval_fraction", "eval_every")}
    settings.update(stage=stage, steps=STEPS, grad_accum=ACCUM, lr=1e-2 if stage != "rm" else 1e-3)
    if stage != "rm":
        settings["beta"] = BETA
    seen: list[tuple[dict, torch.Tensor]] = []
    forwards: list[int] = []
    forward, step = Engine.__call__, Engine.step
    inside = [False]

    def counted_forward(self, *args, **kwargs):
        if inside[0]:
            forwards[-1] += 1
        return forward(self, *args, **kwargs)

    def old_way(self, **inputs):
        # The masters move only after a step's last micro-batch: a forward-only pass here sees the
        # policy the step starts from, as the stage's pass before the step's first micro-batch did.
        rows = {k: v for k, v in inputs.items() if k not in TRAINING_ONLY}
        seen.append((inputs, torch.as_tensor(forward(self, **rows)).float().clone()))
        return step(self, **inputs)

    stage_step = STAGES[stage].step

    def counted_step(self, engine, position):
        forwards.append(0)
        inside[0] = True
        try:
            return stage_step(self, engine, position)
        finally:
            inside[0] = False
    monkeypatch.setattr(Engine, "__call__", counted_forward)
    monkeypatch.setattr(Engine, "step", old_way)
    monkeypatch.setattr(STAGES[stage], "step", counted_step)
    run(load(files.run_yaml(str(tmp_path / f"{stage}.yaml"), **settings), []))
    return log.read(str(tmp_path / "run" / "log.csv")), seen, forwards


def _expected(stage: str, step: list[tuple[dict, torch.Tensor]]) -> dict[str, float]:
    """A step's logged columns from its micro-batches' forward-only values, as the stage logged them."""
    if stage == "rm":
        both = [(v[:len(v) // 2], v[len(v) // 2:]) for _, v in step]
        chosen, rejected = torch.cat([c for c, _ in both]), torch.cat([r for _, r in both])
        return preference_metrics(torch.cat([chosen, rejected]), torch.zeros(2 * len(chosen)), 1.0)
    if stage == "dpo":
        halves = lambda ts: torch.cat([torch.cat([t[:len(t) // 2] for t in ts]),   # noqa: E731
                                       torch.cat([t[len(t) // 2:] for t in ts])])
        return preference_metrics(halves([v for _, v in step]), halves([i["ref_logps"] for i, _ in step]), BETA)
    rewards = BETA * (torch.cat([v for _, v in step]) - torch.cat([i["ref_logps"] for i, _ in step]))
    wanted = torch.cat([i["desirable"] for i, _ in step]).bool()
    mean = lambda x: x.mean().item() if x.numel() else math.nan      # noqa: E731
    return {"rewards_chosen": mean(rewards[wanted]), "rewards_rejected": mean(rewards[~wanted])}


@pytest.mark.parametrize("stage", ["dpo", "rm", "kto"])
def test_the_logged_rewards_come_from_the_training_forward_with_todays_values(tmp_path, monkeypatch, stage):
    rows, seen, forwards = _run(tmp_path, monkeypatch, stage)
    assert len(rows) == STEPS and len(seen) == STEPS * ACCUM
    for s, row in enumerate(rows):
        want = _expected(stage, seen[s * ACCUM:(s + 1) * ACCUM])
        for column, value in want.items():
            assert float(row[column]) == pytest.approx(value, rel=1e-6, abs=1e-7), (s, column)
    assert any(float(r["rewards_chosen"]) != 0.0 for r in rows[1:])        # the policy moved
    # the forward-only passes inside a step: kto's KL rows, an input of its loss; nothing more
    assert forwards == [ACCUM if stage == "kto" else 0] * STEPS
