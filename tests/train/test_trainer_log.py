"""trainer_log.jsonl as LlamaFactory writes it (train/trainer_log.py): a line every log_every steps
whose loss is the mean of the steps' losses since the line before, rounded as the Trainer logs it,
a line of its own for each evaluation, and a resumed run's file without the lines past its
checkpoint."""
from __future__ import annotations

import json
import os

from megacompile.train import load, log, run
from tests.train import files

TEXT = "the cat sat on the mat. " * 8
TINY = dict(model="bundled", bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64), device="cpu",
            seq=16, data=["d.txt"], run_dir="run", log_every=2, eval=["d.txt"], eval_every=3, save_every=1)


def _lines(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "trainer_log.jsonl") as f:
        return [json.loads(line) for line in f]


def _run(tmp_path, **settings) -> None:
    (tmp_path / "d.txt").write_text(TEXT)
    run(load(files.run_yaml(str(tmp_path / "run.yaml"), **{**TINY, **settings}), []))


def test_the_lines_are_llamafactorys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, steps=5)
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    losses = [float(r["loss"]) for r in rows]
    lines = _lines(tmp_path)
    assert [(x["current_steps"], "loss" in x, "eval_loss" in x) for x in lines] == [
        (2, True, False), (3, False, True), (4, True, False), (5, True, False), (5, False, True)]
    assert [x["loss"] for x in lines if "loss" in x] == [round(sum(losses[0:2]) / 2, 4), round(sum(losses[2:4]) / 2, 4),
                                                        round(losses[4], 4)]
    assert lines[0]["lr"] == float(rows[1]["lr"]) and lines[1]["eval_loss"] == float(rows[2]["eval_loss"])
    assert {x["total_steps"] for x in lines} == {5} and lines[-1]["percentage"] == 100.0
    assert all(set(x) >= {"elapsed_time", "remaining_time"} for x in lines)
    assert lines[0]["percentage"] == 40.0
    with open(tmp_path / "run" / "trainer_state.json") as f:      # the epoch of its log_history's records
        epochs = {(r["step"], "loss" in r, "eval_loss" in r): r["epoch"] for r in json.load(f)["log_history"]}
    assert [x["epoch"] for x in lines] == [epochs[x["current_steps"], "loss" in x, "eval_loss" in x] for x in lines]
    assert 0 < lines[0]["epoch"] < lines[-1]["epoch"]
    assert list(lines[0]) == ["current_steps", "total_steps", "loss", "lr", "epoch", "percentage", "elapsed_time",
                              "remaining_time"]     # LlamaFactory's order


def test_a_streamed_run_writes_no_epoch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, steps=2, streaming=True, eval=[], eval_every=None)
    lines = _lines(tmp_path)
    assert [x["current_steps"] for x in lines] == [2] and "epoch" not in lines[0] and "loss" in lines[0]


def test_a_resumed_run_drops_the_lines_past_its_checkpoint_and_writes_the_uninterrupted_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(tmp_path, steps=5, eval_on_start=True)
    with open(tmp_path / "run" / "trainer_log.jsonl", "a") as f:
        f.write('{"current_steps": 5, "lo')      # a line a kill cut short
    _run(tmp_path, steps=6, eval_on_start=True, resume=os.path.join("run", "checkpoints", "step-000003"))
    lines = _lines(tmp_path)
    assert [x["current_steps"] for x in lines] == [0, 2, 3, 4, 6, 6]     # eval_on_start's line kept
    # step 4's line averages steps 3 and 4, step 3 trained before the checkpoint, as trainer_state.json's
    # log_history (and the uninterrupted run's line) has it
    losses = {int(r["step"]): float(r["loss"]) for r in log.read(str(tmp_path / "run" / "log.csv")) if r["loss"]}
    assert [x["loss"] for x in lines if "loss" in x] == [round((losses[1] + losses[2]) / 2, 4),
                                                        round((losses[3] + losses[4]) / 2, 4),
                                                        round((losses[5] + losses[6]) / 2, 4)]
    with open(tmp_path / "run" / "trainer_state.json") as f:
        history = [r for r in json.load(f)["log_history"] if "loss" in r]
    assert [x["loss"] for x in lines if "loss" in x] == [r["loss"] for r in history]
