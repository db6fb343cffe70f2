"""early_stopping_patience (LlamaFactory's early_stopping_steps): the run stops at the evaluation
transformers' EarlyStoppingCallback stops the Trainer at, judged against the Trainer's own best
metric, writes that step's checkpoint and its model, and is complete when run again."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import early_stopping, load, log, run
from tests.train import files


def _trainer_stops(values: list[float], patience: int, greater: bool, tmp_path) -> int | None:
    """The index of the evaluation after which transformers' EarlyStoppingCallback stops the
    Trainer (None: it does not), the Trainer updating its best metric after each, as it does."""
    from transformers import EarlyStoppingCallback, Trainer, TrainerControl, TrainerState, TrainingArguments
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), eval_strategy="steps", metric_for_best_model="eval_loss",
                             greater_is_better=greater, report_to=[], use_cpu=True)
    state, control = TrainerState(), TrainerControl()
    callback = EarlyStoppingCallback(early_stopping_patience=patience)
    for i, value in enumerate(values):
        callback.on_evaluate(args, state, control, metrics={"eval_loss": value})
        Trainer._determine_best_metric(SimpleNamespace(args=args, state=state), {"eval_loss": value}, None)
        if control.should_training_stop:
            return i
    return None


@pytest.mark.parametrize("values, patience, greater", [
    ([3.0, 2.0, 2.5, 2.4, 1.0, 1.5], 2, False),         # waits reset at 1.0
    ([3.0, 2.0, 2.0, 2.5], 2, False),                   # an equal value is no improvement
    ([3.0, 2.0, 1.0, 0.5], 1, True),                    # greater is better: every drop waits
    ([math.nan, 3.0, 3.0], 1, False),                   # a NaN first: the best is inf, then 3.0
])
def test_the_count_is_transformers_early_stopping_callbacks(tmp_path, values, patience, greater):
    c = SimpleNamespace(early_stopping_patience=patience, metric_for_best_model=None, greater_is_better=greater)
    ours = early_stopping.Patience(c, None)
    stopped = None
    for i, value in enumerate(values):
        ours.evaluated({"eval_loss": value})
        if ours.stop:
            stopped = i
            break
    assert stopped == _trainer_stops(values, patience, greater, tmp_path)


def test_a_run_stops_where_the_trainer_would_and_is_complete_after(tmp_path, capsys):
    """greater_is_better: true over a falling loss: no evaluation after the first improves, so the
    run stops two evaluations later, at step 3 of 10."""
    work = files.workspace(tmp_path)
    config = files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=work["chats"], eval=work["chats"],
                            seq=24, batch=2, steps=10, lr=1e-2, schedule="constant", eval_steps=1, save_every=5,
                            early_stopping_steps=2, metric_for_best_model="loss", greater_is_better=True,
                            device="cpu", run_dir=str(tmp_path / "run"))
    result = run(load(config, []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    losses = [float(r["eval_loss"]) for r in rows]
    stop = _trainer_stops(losses + [-math.inf] * 10, 2, True, tmp_path)
    assert result["steps"] == len(rows) == stop + 1 == 3
    assert "early stop     step 3: eval_loss has not improved for 2 evaluations" in capsys.readouterr().out
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step-000003")     # save_every 5: the stop's own
    assert os.path.isfile(tmp_path / "run" / "model.safetensors")
    # LlamaFactory's trainer_log.jsonl logs the step the run ends at, not a logging step (log_every 10),
    # as trainer_state.json's log_history does: the mean loss of steps 1 to 3, then the evaluation
    with open(tmp_path / "run" / "trainer_log.jsonl") as f:
        lines = [json.loads(line) for line in f]
    with open(tmp_path / "run" / "trainer_state.json") as f:
        history = json.load(f)["log_history"][:-1]      # the train figures last, of no line
    assert [(x["current_steps"], x.get("loss"), x.get("eval_loss")) for x in lines] == [
        (r["step"], r.get("loss"), r.get("eval_loss")) for r in history]
    assert [(x["current_steps"], "loss" in x) for x in lines] == [(1, False), (2, False), (3, True), (3, False)]
    assert lines[2]["loss"] == round(sum(float(r["loss"]) for r in rows) / 3, 4)
    run(load(config, ["resume=auto"]))
    assert "already complete (stopped early at step 3 of 10" in capsys.readouterr().out
    assert len(log.read(str(tmp_path / "run" / "log.csv"))) == 3


def test_it_needs_evaluations_of_a_metric_the_stage_evaluates(tmp_path):
    work = files.workspace(tmp_path)
    settings = dict(model=work["model"], data=work["chats"], seq=24, batch=2, steps=2, device="cpu",
                    run_dir=str(tmp_path / "run"), early_stopping_steps=2)
    with pytest.raises(ArgumentError, match="early_stopping_patience .early_stopping_steps. stops the run"):
        load(files.run_yaml(str(tmp_path / "a.yaml"), **settings), [])
    with pytest.raises(ArgumentError, match="metric_for_best_model eval_reward is not evaluated by stage sft"):
        run(load(files.run_yaml(str(tmp_path / "b.yaml"), **settings, eval_fraction=0.25, eval_steps=1,
                                metric_for_best_model="reward"), []))


def test_a_resumed_run_goes_on_counting(tmp_path, capsys):
    """Stopped after step 2 (one evaluation without improvement so far), then resumed to 10: it
    stops at step 3, as the run that was never stopped."""
    work = files.workspace(tmp_path)
    settings = dict(model=work["model"], data=work["chats"], eval=work["chats"], seq=24, batch=2, lr=1e-2,
                    schedule="constant", eval_steps=1, early_stopping_steps=2, metric_for_best_model="loss",
                    greater_is_better=True, device="cpu", run_dir=str(tmp_path / "run"), resume="auto")
    run(load(files.run_yaml(str(tmp_path / "a.yaml"), **settings, steps=2), []))
    assert run(load(files.run_yaml(str(tmp_path / "b.yaml"), **settings, steps=10), []))["steps"] == 3
    assert "early stop     step 3: eval_loss has not improved for 2 evaluations" in capsys.readouterr().out


def test_a_count_judged_by_other_evaluations_starts_afresh_on_resume(tmp_path):
    """As the best model's: a resume under another metric or other eval data does not compare its
    evaluations with a best they do not measure alike; it says so and counts afresh."""
    from megacompile.train import best_model, resume

    work = files.workspace(tmp_path)
    settings = dict(model=work["model"], data=work["chats"], eval=work["chats"], seq=24, batch=2, steps=4,
                    eval_steps=1, early_stopping_steps=2, device="cpu", run_dir=str(tmp_path / "run"))

    def config(**extra):
        return load(files.run_yaml(str(tmp_path / "r.yaml"), **settings | extra), [])

    first = early_stopping.Patience(config(), None)
    for value in (1.0, 2.0):
        first.evaluated({"eval_loss": value})
    saved = resume.Saved("ckpt", 2, first.extra())
    assert first.extra()["early_stopping"]["under"]["metric_for_best_model"] == "eval_loss"
    same = early_stopping.Patience(config(), saved.extra)
    assert resume.notes(config(), saved) == [] and (same.best, same.waited) == (1.0, 1)

    # another metric: its values are not compared with the saved eval_loss
    c = config(metric_for_best_model="perplexity")
    (note,) = resume.notes(c, saved)
    assert note.startswith("metric_for_best_model eval_loss -> eval_perplexity, greater_is_better False -> True: "
                           "early stopping's best so far (1, then 1 evaluation without improvement) was judged by "
                           "other evaluations")
    assert "the count starts afresh from step 3" in note
    again = early_stopping.Patience(c, saved.extra)
    again.evaluated({"eval_perplexity": 7.0})      # whatever its value, the first is the best
    assert (again.best, again.waited) == (7.0, 0)

    # under load_best_model_at_end the best model's record of what judged it is read, not kept twice
    c = config(load_best_model_at_end=True, save_every=1)
    proposed = best_model.Best(c, None).proposed(2, {"eval_loss": 1.0})
    counted = early_stopping.Patience(c, None)
    counted.evaluated({"eval_loss": 1.0})
    kept = counted.extra(proposed)
    assert "under" not in kept["early_stopping"]
    both = resume.Saved("ckpt", 2, {"best": proposed, **kept})
    assert resume.notes(c, both) == []
    with open(work["chats"], "a") as f:     # the same eval file, changed: both start afresh
        f.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    assert [n.split(": ", 2)[2][:30] for n in resume.notes(c, both)] == [
        "the best checkpoint so far (st", "early stopping's best so far ("]
    assert early_stopping.Patience(c, both.extra).best is None

    # a checkpoint saved before the count kept what judged it: counted on as before
    old = {"early_stopping": {"best": 1.0, "waited": 1, "stopped": False}}
    assert early_stopping.Patience(config(metric_for_best_model="perplexity"), old).waited == 1
