"""run.yaml stages as a TRL user brings them: a conversational GRPO dataset with reward functions
written for TRL (keywords, message-list completions, None for samples they do not score, an async
one that scores nothing) runs to the end and logs nan-aware per-reward means; a skipped step (an
inf or NaN loss) is logged, not a crash, in grpo and dpo; a row too long for the model names the
keys that set its length."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megacompile.errors import ArgumentError, NonFiniteError
from megacompile.train.stages import grpo as grpo_stage
from megacompile.train import load, log, run
from megacompile.train.stages.dpo import DPOStage
from tests.posttrain import stage_files, trl_rewards
from tests.train import files

FUNCS = ["tests.posttrain.trl_rewards:says_answer", "tests.posttrain.trl_rewards:long_only",
         "tests.posttrain.trl_rewards:never"]


def _conversations(path: str) -> str:
    with open(path, "w") as f:
        for s in files.SENTENCES:
            f.write(json.dumps({"prompt": [{"role": "user", "content": s}], "answer": s.split()[0]}) + "\n")
    return path


def _nanmean(xs):
    kept = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(kept) / len(kept) if kept else math.nan


@pytest.mark.slow
def test_a_trl_grpo_config_with_trl_reward_functions_runs_and_logs_each_reward(tmp_path):
    work = stage_files.workspace(tmp_path)
    trl_rewards.CALLS.clear()
    settings = stage_files.grpo(work, str(tmp_path / "run"), data=_conversations(str(tmp_path / "chat.jsonl")),
                                reward_funcs=FUNCS, reward_weights=[1.0, 0.5, 2.0], max_completion_length=4,
                                scale_rewards=False, mask_truncated_completions=True)
    del settings["batch"], settings["steps"], settings["lr"]
    settings.update(per_device_train_batch_size=8, max_steps=2, learning_rate=1e-2)
    result = run(load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings), []))
    assert result["steps"] == 2
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert len(rows) == 2 == len(trl_rewards.CALLS)
    for step, (row, call) in enumerate(zip(rows, trl_rewards.CALLS)):
        assert call["keys"] == ["completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in call["completions"])
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in call["prompts"])
        assert all(isinstance(ids, list) and 1 <= len(ids) <= 4 for ids in call["completion_ids"])
        state = call["trainer_state"]
        assert (state.global_step, state.max_steps) == (step, 2) and state.epoch == pytest.approx(step * 2 / 10)
        said = [1.0 if c[0]["content"].split()[:1] == [a] else 0.0 for c, a in zip(call["completions"],
                                                                                     call["answer"])]
        long = trl_rewards.long_only(call["completions"])
        assert float(row["rewards/says_answer/mean"]) == pytest.approx(sum(said) / 8)
        assert float(row["rewards/long_only/mean"]) == pytest.approx(_nanmean(long)) or (
            math.isnan(_nanmean(long)) and math.isnan(float(row["rewards/long_only/mean"])))
        assert math.isnan(float(row["rewards/never/mean"]))
        # None and NaN left out of the sum: each completion's reward is its scored terms only
        total = [s + (0.5 * x if x is not None else 0.0) for s, x in zip(said, long)]
        assert float(row["reward"]) == pytest.approx(sum(total) / 8)
        assert row["skipped"] in ("", "None")


def test_a_trl_grpo_config_learns_a_toy_reward(tmp_path):
    """TRL's keys, a conversational dataset, reward functions written for TRL (one learnable, one
    that scores some completions and returns None for the rest, an async one that returns NaN for
    all): the learnable reward's mean goes from chance to nearly always in 30 steps, seeded."""
    work = stage_files.workspace(tmp_path)
    settings = stage_files.grpo(work, str(tmp_path / "run"), data=_conversations(str(tmp_path / "chat.jsonl")),
                                reward_funcs=["tests.posttrain.trl_rewards:says_the",
                                              "tests.posttrain.trl_rewards:long_only",
                                              "tests.posttrain.trl_rewards:never"],
                                reward_weights=[1.0, 0.1, 1.0], max_completion_length=2)
    del settings["batch"], settings["steps"], settings["lr"]
    settings.update(per_device_train_batch_size=16, max_steps=30, learning_rate=1e-2)
    result = run(load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings), []))
    assert result["steps"] == 30
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    learned = [float(r["rewards/says_the/mean"]) for r in rows]
    assert sum(learned[:3]) / 3 < 0.2 and sum(learned[-3:]) / 3 >= 0.9, learned
    assert all(math.isnan(float(r["rewards/never/mean"])) for r in rows)
    assert all(math.isfinite(float(r["loss"])) for r in rows)


def _poisoned_rollout_batch(*args, **kwargs):
    batch = rollout_batch(*args, **kwargs)
    if not _poisoned_rollout_batch.done:
        _poisoned_rollout_batch.done = True
        batch["advantages"] = torch.full_like(batch["advantages"], math.nan)
    return batch


rollout_batch = grpo_stage.rollout_batch


def test_a_skipped_grpo_step_is_logged_and_the_run_goes_on(tmp_path, monkeypatch):
    work = stage_files.workspace(tmp_path)
    _poisoned_rollout_batch.done = False
    monkeypatch.setattr(grpo_stage, "rollout_batch", _poisoned_rollout_batch)
    result = run(load(files.run_yaml(str(tmp_path / "grpo.yaml"), **stage_files.grpo(work, str(tmp_path / "run"))),
                      []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [r["skipped"] for r in rows][0] == "loss" and rows[-1]["skipped"] in ("", "None")
    assert int(rows[0]["tokens"]) == 8 * (8 + 3)            # the rollout's rows, read though skipped
    assert result["steps"] == 2


def test_a_skipped_dpo_step_is_logged_and_the_run_goes_on(tmp_path, monkeypatch):
    work = stage_files.workspace(tmp_path)
    begin = DPOStage.begin

    def poisoned(self, engine, run_dir, saved, batch):
        begin(self, engine, run_dir, saved, batch)
        self.table = torch.full_like(self.table, math.nan)
    monkeypatch.setattr(DPOStage, "begin", poisoned)
    settings = stage_files.dpo(work, str(tmp_path / "run"), steps=2, max_consecutive_skips=2)
    del settings["eval_fraction"], settings["eval_every"]
    # every step skips (the reference is NaN): the run stops after two in a row, as it says
    with pytest.raises(NonFiniteError):
        run(load(files.run_yaml(str(tmp_path / "dpo.yaml"), **settings), []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [r["skipped"] for r in rows] == ["loss", "loss"]
    assert int(rows[0]["tokens"]) == 2 * 2 * 16


def test_a_grpo_row_too_long_for_the_model_names_the_keys_that_set_it(tmp_path):
    work = stage_files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "grpo.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), max_prompt_length=200, max_completion_length=100))
    with pytest.raises(ArgumentError) as caught:
        run(load(config, []))
    message = str(caught.value)
    assert "max_prompt_length 200 + max_completion_length 100 = 300 tokens" in message
    assert "lower max_prompt_length or max_completion_length" in message and "seq" not in message
    assert not os.path.exists(tmp_path / "run")
