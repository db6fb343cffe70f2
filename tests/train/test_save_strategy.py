"""transformers' checkpoint and evaluation keys behave as its Trainer does: save_strategy: steps
without save_steps saves every 500 steps; logging_steps, eval_steps and save_steps below 1 are
fractions of the run's steps, rounded up as TrainerState.compute_steps rounds them; eval_strategy
and save_strategy `epoch` evaluate and save at each epoch's end and after the last step; what
megacompile cannot do is refused by name."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files

TEXT = "the cat sat on the mat. " * 8       # 192 bytes: 12 rows of 16 bytes an epoch
TINY = dict(model="bundled", bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu",
            seq=16)


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.txt").write_text(TEXT)
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**TINY, "data": ["d.txt"], "output_dir": "run", **settings})


def _checkpoints(tmp_path) -> list[int]:
    return sorted(int(name.split("-")[1]) for name in os.listdir(tmp_path / "run" / "checkpoints"))


def _evaluated(tmp_path) -> list[int]:
    return [int(r["step"]) for r in log.read(str(tmp_path / "run" / "log.csv")) if r["eval_loss"]]


def test_save_strategy_steps_without_save_steps_saves_every_500_steps_as_transformers(tmp_path, capsys):
    c = load(_yaml(tmp_path, max_steps=1200, save_strategy="steps"))
    assert c.save_every == 500
    assert "save_strategy: steps without save_steps saves a checkpoint every 500 steps" in capsys.readouterr().out
    assert load(_yaml(tmp_path, max_steps=1200, save_strategy="steps", save_steps=40)).save_every == 40
    assert load(_yaml(tmp_path, max_steps=1200)).save_every is None       # neither: after the last step only


@pytest.mark.parametrize("given", [
    {"save_steps": 0.25, "logging_steps": 0.1, "eval_steps": 0.3},
    {"save_steps": 0.001, "logging_steps": 0.999, "eval_steps": 0.05},
    {"save_steps": "1e-1", "logging_steps": 2, "eval_steps": 500.0},
])
@pytest.mark.parametrize("max_steps", [7, 10, 1234])
def test_fractions_of_the_steps_round_up_as_transformers_compute_steps(tmp_path, given, max_steps):
    from transformers import TrainerState
    c = load(_yaml(tmp_path, max_steps=max_steps, eval=["d.txt"], **given))
    theirs = TrainerState()
    theirs.compute_steps(SimpleNamespace(**{k: float(v) for k, v in given.items()}), max_steps)
    assert (c.save_every, c.log_every, c.eval_every) == (theirs.save_steps, theirs.logging_steps, theirs.eval_steps)
    assert all(isinstance(v, int) for v in (c.save_every, c.log_every, c.eval_every))


def test_eval_strategy_steps_takes_a_fraction_from_logging_steps(tmp_path):
    c = load(_yaml(tmp_path, max_steps=40, eval=["d.txt"], eval_strategy="steps", logging_steps=0.1))
    assert c.eval_every == c.log_every == 4


def test_epochs_end_where_the_data_says_and_the_run_evaluates_and_saves_there(tmp_path, capsys):
    # 12 rows an epoch, 5 a step: epochs end at steps ceil(12 / 5) = 3 and ceil(24 / 5) = 5; the half
    # epoch after them ends the run at ceil(30 / 5) = 6, which saves and evaluates too.
    c = load(_yaml(tmp_path, batch=5, num_train_epochs=2.5, save_strategy="epoch", save_steps=500,
                   eval_strategy="epoch", eval=["d.txt"], save_total_limit=None))
    assert (c.save_every, c.eval_every, c.keep_last) == ("epoch", "epoch", None)   # save_total_limit: null keeps all
    for kept_all in (0, -1):    # transformers rotates no checkpoint at 0 or below either
        assert load(_yaml(tmp_path, max_steps=4, save_total_limit=kept_all)).keep_last is None
    assert "save_steps: 500 is not used: save_strategy is epoch" in capsys.readouterr().out
    result = run(c)
    assert result["steps"] == 6 and c.save_every == c.eval_every == (3, 5, 6)
    assert _checkpoints(tmp_path) == [3, 5, 6]
    assert _evaluated(tmp_path) == [3, 5, 6]


def test_a_fraction_with_epochs_waits_for_the_steps_the_data_gives(tmp_path):
    c = load(_yaml(tmp_path, batch=4, num_train_epochs=2, save_steps=0.4, logging_steps=0.5, save_total_limit=None))
    assert (c.steps, c.save_every, c.log_every) == (None, 0.4, 0.5)
    run(c)
    assert (c.steps, c.save_every, c.log_every) == (6, 3, 3)          # ceil(6 x 0.4), ceil(6 x 0.5)
    assert _checkpoints(tmp_path) == [3, 6]


def test_save_strategy_epoch_with_max_steps_saves_at_the_epochs_ends_within_them(tmp_path):
    c = load(_yaml(tmp_path, batch=4, max_steps=7, save_strategy="epoch", save_total_limit=None))
    run(c)
    assert _checkpoints(tmp_path) == [3, 6, 7]          # 3 steps an epoch; the last step saves as always


@pytest.mark.parametrize("settings, message", [
    ({"save_strategy": "best"}, "save_strategy 'best': megacompile saves every save_steps steps or at each epoch's "
                                "end; give save_strategy: steps, epoch or no"),
    ({"evaluation_strategy": "best"}, "evaluation_strategy 'best': megacompile evaluates every eval_steps steps"),
    ({"logging_strategy": "epoch"}, "logging_strategy 'epoch': log.csv has a row for every optimizer step"),
    ({"save_steps": 1.5}, r"save_steps \(megacompile's save_every\): save_every must be a whole number >= 1"),
    ({"logging_steps": "epoch"}, "log_every must be a whole number >= 1 .* below 1; got 'epoch'"),
    ({"eval_steps": 0.0, "eval": ["d.txt"]}, r"eval_steps \(megacompile's eval_every\): eval_every must be a whole"),
    ({"streaming": True, "save_strategy": "epoch"}, "streaming does not know the data's size ahead, so the end of "
                                                    "an epoch is not known"),
    ({"load_best_model_at_end": True}, "load_best_model_at_end keeps the checkpoint whose evaluation was best: give "
                                       "held-out data"),     # test_best_model.py: what it does with them
])
def test_what_the_trainer_does_and_megacompile_cannot_is_refused_by_name(tmp_path, settings, message):
    with pytest.raises(ArgumentError, match=message):
        load(_yaml(tmp_path, max_steps=4, **settings))
    assert not os.path.exists(tmp_path / "run")


def test_grpo_refuses_a_fraction_it_cannot_place_between_rollout_batches_before_the_data_is_read(tmp_path):
    from tests.posttrain import stage_files
    work = stage_files.workspace(tmp_path)
    settings = stage_files.grpo(work, str(tmp_path / "run"), steps_per_generation=2, num_iterations=2)
    del settings["steps"]
    with pytest.raises(ArgumentError, match=r"save_every 0.5 is a fraction of the steps, which epochs give once the "
                                            r"prompts are read.*multiple of 4, or epoch"):
        load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings, epochs=2, save_every=0.5))
