"""The run's end figures as transformers' Trainer writes them (train/results.py): train_results.json,
eval_results.json, all_results.json and trainer_state.json, each read back from log.csv over the
whole run (a resumed one too), trainer_state.json loaded by transformers' own TrainerState, and
each checkpoint's own, of the run up to its step, committed with it; with plot_loss, LlamaFactory's
pictures."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re

import pytest
from transformers import TrainerState

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.loss_plot import smoothed
from tests.train import files


def _yaml(tmp_path, **more) -> str:
    model = str(tmp_path / "model")
    if not os.path.isdir(model):
        files.model_dir(model, layers=1, dim=32)
        files.chats(str(tmp_path / "chats.jsonl"))
    settings = dict(model=model, data=str(tmp_path / "chats.jsonl"), seq=24, batch=1, grad_accum=2, steps=5, lr=1e-3,
                    warmup=0, schedule="constant", device="cpu", resume="auto", run_dir=str(tmp_path / "run"),
                    log_every=2, eval_fraction=0.25, eval_every=2, save_every=2, log="csv")
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**settings, **more})


def _json(tmp_path, name: str) -> dict:
    with open(tmp_path / "run" / name) as f:
        return json.load(f)


def _rows(tmp_path) -> list[dict]:
    return log.read(str(tmp_path / "run" / "log.csv"))


def test_the_trainers_files_hold_the_whole_runs_figures_and_transformers_reads_its_state(tmp_path, capsys,
                                                                                         monkeypatch):
    committed = _watch_commits(monkeypatch)
    result = run(load(_yaml(tmp_path, plot_loss=True, save_every=1), []))
    out = capsys.readouterr().out
    assert "results        train_results.json, all_results.json, eval_results.json, trainer_state.json, " \
           "training_loss.png, training_eval_loss.png in " in out
    # the logged epoch counts the rows read: 2 a step (stages/epochs.py)
    steps_per_epoch = int(re.search(r"; 5 steps, (\d+) rows an epoch", out).group(1)) / 2
    rows = _rows(tmp_path)
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 5
    train = _json(tmp_path, "train_results.json")
    assert train["train_loss"] == pytest.approx(sum(losses) / 5, rel=1e-12)
    assert 0 < train["epoch"] == pytest.approx(5 / steps_per_epoch, abs=1e-4)
    assert train["train_runtime"] == pytest.approx(result["seconds"], abs=1e-3)
    assert train["train_steps_per_second"] == pytest.approx(5 / result["seconds"], rel=1e-2)
    assert train["train_samples_per_second"] == pytest.approx(2 * 5 / result["seconds"], rel=1e-2)
    tokens = sum(int(r["tokens"]) for r in rows)
    assert train["total_flos"] > 6 * tokens * 1000 and train["total_flos"] % (6 * tokens) == 0
    last_eval = float(rows[-1]["eval_loss"])
    assert _json(tmp_path, "eval_results.json")["eval_loss"] == last_eval
    assert _json(tmp_path, "all_results.json") == {**train, "eval_loss": last_eval,
                                                   "eval_perplexity": float(rows[-1]["eval_perplexity"])}

    state = _json(tmp_path, "trainer_state.json")
    logged = [r for r in state["log_history"] if "loss" in r]
    # a record every log_every steps and at the last, the mean loss since the record before
    assert [r["step"] for r in logged] == [2, 4, 5]
    assert [r["loss"] for r in logged] == [round((losses[0] + losses[1]) / 2, 4),
                                           round((losses[2] + losses[3]) / 2, 4), round(losses[4], 4)]
    assert [r["learning_rate"] for r in logged] == [float(rows[i]["lr"]) for i in (1, 3, 4)]
    evaluated = [r for r in state["log_history"] if "eval_loss" in r]
    assert [(r["step"], r["eval_loss"]) for r in evaluated] == [(int(r["step"]), float(r["eval_loss"]))
                                                                for r in rows if r["eval_loss"]]
    assert state["log_history"][-1]["train_loss"] == train["train_loss"]
    read = TrainerState.load_from_json(str(tmp_path / "run" / "trainer_state.json"))
    assert (read.global_step, read.max_steps, read.logging_steps, read.eval_steps, read.save_steps) == (5, 5, 2, 2, 1)
    assert read.train_batch_size == 1 and read.log_history == state["log_history"]
    for name in ("training_loss.png", "training_eval_loss.png"):
        with open(tmp_path / "run" / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # Each checkpoint's own trainer_state.json: the run up to its step, in the folder when it was committed;
    # step 3's has no record of step 3 (not a logging step, nor the last).
    assert committed == {f"step-{n:06d}": True for n in range(1, 6)}
    tokens = [int(r["tokens"]) for r in rows]
    for n in (3, 4, 5):         # keep_last: 3
        path = tmp_path / "run" / "checkpoints" / f"step-{n:06d}" / "trainer_state.json"
        with open(path) as f:
            saved = json.load(f)
        assert {f.name for f in dataclasses.fields(TrainerState)} <= set(saved)
        assert (saved["global_step"], saved["max_steps"], saved["epoch"]) == (n, 5, round(n / steps_per_epoch, 4))
        assert saved["num_input_tokens_seen"] == sum(tokens[:n])
        assert saved["total_flos"] == pytest.approx(state["total_flos"] / sum(tokens) * sum(tokens[:n]), rel=1e-12)
        assert saved["log_history"] == [r for r in state["log_history"][:-1] if r["step"] <= n]
        assert TrainerState.load_from_json(str(path)).log_history == saved["log_history"]
    assert {k: v for k, v in saved.items() if k != "log_history"} == {
        k: v for k, v in state.items() if k != "log_history"}      # the last step's: the run's but the train figures


def _watch_commits(monkeypatch) -> dict:
    """Checkpoint name -> whether trainer_state.json was in its folder when the folder was committed."""
    from megacompile.io import durable
    seen, real = {}, durable.rename_into_place

    def watched(tmp, path):
        names = os.listdir(tmp)
        if durable.MARKER in names:
            seen[os.path.basename(path)] = "trainer_state.json" in names
        return real(tmp, path)
    monkeypatch.setattr(durable, "rename_into_place", watched)
    return seen


def test_a_resumed_runs_train_loss_counts_the_steps_before_its_checkpoint(tmp_path):
    run(load(_yaml(tmp_path, eval_every=None, eval_fraction=0, log_every=1), ["steps=2"]))
    run(load(_yaml(tmp_path, eval_every=None, eval_fraction=0, log_every=1), ["steps=4"]))
    losses = [float(r["loss"]) for r in _rows(tmp_path)]
    assert len(losses) == 4
    train = _json(tmp_path, "train_results.json")
    assert train["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-12)
    assert not os.path.exists(tmp_path / "run" / "eval_results.json")      # no evaluation ran
    assert "eval_loss" not in _json(tmp_path, "all_results.json")
    state = _json(tmp_path, "trainer_state.json")
    assert [r["step"] for r in state["log_history"] if "loss" in r] == [1, 2, 3, 4]
    # the resumed run's checkpoint carries the history from step 1
    with open(tmp_path / "run" / "checkpoints" / "step-000004" / "trainer_state.json") as f:
        assert json.load(f)["log_history"] == state["log_history"][:-1]
    assert not os.path.exists(tmp_path / "run" / "training_loss.png")      # plot_loss not asked for


def test_plot_loss_without_matplotlib_is_refused_before_the_run(tmp_path, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else found(name, *a))
    with pytest.raises(ArgumentError, match=r"plot_loss: true draws training_loss.png with matplotlib, which is not "
                                            r"installed: pip install 'megacompile\[plot\]'"):
        load(_yaml(tmp_path, plot_loss=True))
    assert not os.path.exists(tmp_path / "run")


def test_the_smoothed_curve_is_an_average_weighted_by_the_curves_length():
    values = [4.0, 2.0, 3.0]
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * 3)) - 0.5)
    first = 4.0
    second = first * weight + (1 - weight) * 2.0
    assert smoothed(values) == pytest.approx([first, second, second * weight + (1 - weight) * 3.0], rel=1e-15)
    assert smoothed([]) == []
