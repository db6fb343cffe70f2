"""load_best_model_at_end, metric_for_best_model and greater_is_better: the model a run writes is
its best checkpoint's weights, chosen as transformers' Trainer chooses (each checkpoint's own
evaluation; lower is better for a loss unless greater_is_better), the best kept beside keep_last's
latest, carried across a resume; settings under which a checkpoint has no evaluation are refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files, finetune_runs


def _settings(tmp_path, **extra) -> dict:
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    return dict(model=files.model_dir(str(tmp_path / "llama"), dim=32), data=[chats], eval=[chats], eval_batches=1,
                seq=32, batch=2, steps=4, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu",
                run_dir=str(tmp_path / "run"), log_every=1, eval_every=1, save_every=1, save_total_limit=1,
                export_dtype="float32", load_best_model_at_end=True) | extra


def _exported_is_checkpoint(c, step: int) -> None:
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{step:06d}"), "master")
    exported = load_file(os.path.join(c.run_dir, "model.safetensors"))
    assert set(masters) <= set(exported)
    for name, master in masters.items():
        assert torch.equal(exported[name], master), name


def test_the_model_written_is_the_best_checkpoints(tmp_path, capsys):
    # the highest held-out loss is "best": the first step's, on a run whose loss falls
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, greater_is_better=True,
                                                                   metric_for_best_model="loss")), [])
    run(c)
    losses = [float(r["eval_loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    best = 1 + max(range(len(losses)), key=lambda i: losses[i])
    assert best != len(losses)
    assert (f"best           step {best} (eval_loss {losses[best - 1]:.6g}): its checkpoint's weights are the model "
            "written") in capsys.readouterr().out
    _exported_is_checkpoint(c, best)
    # save_total_limit 1: the last checkpoint and the best, as the Trainer keeps them
    assert sorted(os.listdir(os.path.join(c.run_dir, "checkpoints"))) == [f"step-{best:06d}", "step-000004"]
    with open(os.path.join(c.run_dir, "trainer_state.json")) as f:      # as the Trainer's names them
        state = json.load(f)
    assert state["best_metric"] == losses[best - 1]
    assert state["best_model_checkpoint"] == os.path.join(c.run_dir, "checkpoints", f"step-{best:06d}")
    # the final evaluation is the model written's, as LlamaFactory's Trainer.evaluate() after train() makes it:
    # the best step's, made on those weights; the epoch the run's last
    row = log.read(os.path.join(c.run_dir, "log.csv"))[best - 1]
    evaluated = {"eval_loss": float(row["eval_loss"]), "eval_perplexity": float(row["eval_perplexity"])}
    for name in ("eval_results.json", "all_results.json"):
        with open(os.path.join(c.run_dir, name)) as f:
            assert {k: v for k, v in json.load(f).items() if k.startswith("eval_")} == evaluated, name
    with open(os.path.join(c.run_dir, "eval_results.json")) as f:
        assert json.load(f)["epoch"] == state["epoch"]


@pytest.mark.slow
def test_a_loss_is_best_lowest_and_the_last_step_may_be_it(tmp_path, capsys):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path)), [])
    run(c)
    losses = [float(r["eval_loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    best = 1 + min(range(len(losses)), key=lambda i: losses[i])
    assert c.metric_for_best_model == "eval_loss" and c.greater_is_better is False
    out = capsys.readouterr().out
    assert ("best           step" in out) == (best != 4)
    _exported_is_checkpoint(c, best)


@pytest.mark.slow
def test_a_resumed_run_goes_on_comparing_with_the_best_before_it(tmp_path):
    settings = _settings(tmp_path, greater_is_better=True, steps=2, save_total_limit=None)
    run(load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), []))
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings | {"steps": 4, "resume": "auto"}), [])
    run(c)
    losses = [float(r["eval_loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert len(losses) == 4
    _exported_is_checkpoint(c, 1 + max(range(4), key=lambda i: losses[i]))


@pytest.mark.parametrize("extra, says", [
    (dict(eval=None, eval_every=None), "load_best_model_at_end keeps the checkpoint whose evaluation was best: give "
                                       "held-out data"),
    (dict(save_every=False), "save_every: false (save_strategy: no) writes none"),
    (dict(load_best_model_at_end="yes"), "load_best_model_at_end must be true or false"),
])
def test_settings_without_an_evaluated_checkpoint_are_refused(tmp_path, extra, says):
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, **extra)), [])
    assert says in str(e.value)


@pytest.mark.parametrize("extra, says", [
    (dict(save_every=3, eval_every=2), r"the checkpoint at step 3 would have none: save_every \(3\) must be a "
                                       r"multiple of eval_every \(2\)"),
    (dict(save_every=1, eval_every="epoch"), r"the checkpoint at step 1 would have none: save_every \(1\) must be "
                                             r"a multiple of eval_every \(epoch\)"),
    (dict(metric_for_best_model="accuracy"), "metric_for_best_model eval_accuracy is not evaluated by stage sft; it "
                                             "evaluates eval_loss, eval_perplexity"),
])
def test_a_checkpoint_without_its_evaluation_is_refused_before_training(tmp_path, extra, says):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, **extra)), [])
    with pytest.raises(ArgumentError, match=says):
        run(c)
    assert not os.path.isdir(os.path.join(c.run_dir, "checkpoints"))


def test_eval_on_start_evaluates_the_model_it_starts_from(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    from megacompile.train.data import packing
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(
        tmp_path, eval_on_start=True, steps=1, load_best_model_at_end=False)), [])
    run(c)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert [int(r["step"]) for r in logged] == [0, 1] and logged[0]["loss"] == ""
    _, eval_rows = finetune_runs.rows(c, tmp_path, c.seq)
    model = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32).eval()
    with torch.no_grad():
        held = model(**packing.batch(eval_rows, 0, c.batch, shifted=False)).loss.item()
    assert float(logged[0]["eval_loss"]) == pytest.approx(held, rel=1e-5)
    assert f"eval on start  eval_loss {held:.4f}" in capsys.readouterr().out


def test_eval_on_start_without_evaluations_is_refused(tmp_path):
    settings = _settings(tmp_path, eval_on_start=True, load_best_model_at_end=False)
    del settings["eval_every"]
    with pytest.raises(ArgumentError, match="eval_on_start evaluates before the first step"):
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])


def test_a_best_judged_by_other_evaluations_is_judged_afresh_on_resume(tmp_path):
    from megacompile.train.best_model import Best, resume_note
    from megacompile.train.resume import Saved

    settings = _settings(tmp_path)

    def config(**extra):
        return load(files.run_yaml(str(tmp_path / "r.yaml"), **settings | extra), [])

    first = Best(config(), None)
    first.keep(first.proposed(2, {"eval_loss": 1.0}))
    saved = Saved("ckpt", 2, {"best": first.state()})

    same = Best(config(), saved.extra)
    assert resume_note(config(), saved) == [] and same.proposed(4, {"eval_loss": 2.0}) == first.state()

    # another metric: its values are not compared with the saved eval_loss
    c = config(metric_for_best_model="perplexity")
    (note,) = resume_note(c, saved)
    assert note.startswith("metric_for_best_model eval_loss -> eval_perplexity, greater_is_better False -> True: "
                           "the best checkpoint so far (step 2, eval_loss 1) was judged by other evaluations")
    assert "the best is judged afresh from step 3" in note
    best = Best(c, saved.extra)
    assert best.kept(str) == ("2",)      # kept until an evaluation of this run's replaces it
    best.keep(best.proposed(4, {"eval_perplexity": 7.0}))      # whatever its value, the first is the best
    assert best.state()["step"] == 4 and best.kept(str) == ("4",)
    assert best.proposed(6, {"eval_perplexity": 6.0})["step"] == 4      # and the next compared with it
    assert resume_note(c, Saved("ckpt", 4, {"best": best.state()})) == []

    # the same eval file, changed
    with open(tmp_path / "chats.jsonl", "a") as f:
        f.write('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    (note,) = resume_note(config(), saved)
    assert note.startswith(f"eval: {tmp_path / 'chats.jsonl'} changed (another size or modification time)")
    assert Best(config(), saved.extra).proposed(4, {"eval_loss": 2.0})["step"] == 4

    # a checkpoint saved before the best kept what judged it: compared as before
    old = {"best": {"step": 2, "value": 1.0}}
    assert resume_note(config(), Saved("ckpt", 2, old)) == []
    assert Best(config(), old).proposed(4, {"eval_loss": 2.0}) == {"step": 2, "value": 1.0, "under": None}


@pytest.mark.slow
def test_a_resume_under_another_metric_exports_the_best_of_its_own_evaluations(tmp_path, capsys):
    settings = _settings(tmp_path, greater_is_better=True, steps=2, save_total_limit=None)
    run(load(files.run_yaml(str(tmp_path / "r.yaml"), **settings | {"metric_for_best_model": "perplexity"}), []))
    capsys.readouterr()
    # step 1's perplexity (the best so far, the highest) is no loss the resumed run's could be compared with
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings | {"steps": 4, "resume": "auto"}), [])
    run(c)
    assert "metric_for_best_model eval_perplexity -> eval_loss: the best checkpoint so far (step 1" in \
        capsys.readouterr().out
    losses = [float(r["eval_loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    best = 3 + max(range(2), key=lambda i: losses[2 + i])
    _exported_is_checkpoint(c, best)
    with open(os.path.join(c.run_dir, "eval_results.json")) as f:
        assert json.load(f)["eval_loss"] == losses[best - 1]


def test_the_bundled_models_best_checkpoint_is_its_model(tmp_path, capsys):
    """The bundled model is written nowhere but its checkpoints: the best one is the model the run
    names, and names again once complete."""
    tiny = dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64)
    notes = files.text(str(tmp_path / "notes.txt"))
    settings = dict(model="bundled", data=notes, eval=notes, bundled_model=tiny, seq=16, batch=2, steps=3,
                    lr=1e-2, schedule="constant", device="cpu", run_dir=str(tmp_path / "run"), eval_every=1,
                    eval_batches=1, save_every=1, load_best_model_at_end=True, metric_for_best_model="loss",
                    greater_is_better=True, resume="auto")
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    result = run(c)
    losses = [float(r["eval_loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    best = 1 + max(range(len(losses)), key=lambda i: losses[i])
    assert best != 3
    at = os.path.join(c.run_dir, "checkpoints", f"step-{best:06d}")
    out = capsys.readouterr().out
    assert f"step {best} (eval_loss {losses[best - 1]:.6g}): its checkpoint, {at}, is the model" in out
    assert "weights are the model written" not in out
    assert result["model"] == at and f"model: {at} (the bundled model" in out
    assert run(load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), []))["model"] == at
    assert f"model: {at} (the bundled model" in capsys.readouterr().out
