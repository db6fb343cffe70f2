"""The held-out loss of stages sft and pt is transformers' Trainer.evaluate's (so LlamaFactory's and
TRL's): its batches' means averaged with a weight of their rows, the last batch the rows that are
left, checked by running
Trainer.evaluate on the exported model over the same rows; its perplexity is that loss's
exponential. A mean over all the held-out tokens, or over the batches' means unweighted, would be
another figure, and is shown to be."""
from __future__ import annotations

import math
import os

import pytest
import torch

from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

HELD = 5        # held-out records in batches of 2: 2, 2, then 1


def _trainer_loss(model, rows: list[dict], batch: int, folder: str) -> float:
    """Trainer.evaluate's eval_loss of `model` over `rows` in batches of `batch`."""
    from transformers import Trainer, TrainingArguments, default_data_collator
    args = TrainingArguments(output_dir=folder, per_device_eval_batch_size=batch, report_to=[], use_cpu=True)
    return Trainer(model=model, args=args, eval_dataset=rows, data_collator=default_data_collator).evaluate()["eval_loss"]


def _rows(held, docs: range) -> list[dict]:
    return [{k: v[0] for k, v in packing.batch(held, i, 1, shifted=False).items()} for i in docs]


def test_the_held_out_loss_is_what_trainer_evaluate_gives_for_the_trained_model(tmp_path):
    from transformers import AutoModelForCausalLM
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                            data=[files.chats(str(tmp_path / "chats.jsonl"))],
                            eval=[files.chats(str(tmp_path / "held.jsonl"), n=HELD)], seq=64, batch=2, steps=2,
                            lr=1e-2, schedule="constant", device="cpu", run_dir=str(tmp_path / "run"), eval_every=2,
                            export_dtype="float32"), [])
    run(c)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))[-1]
    _, held = finetune_runs.rows(c, tmp_path, c.seq)
    assert held.rows_per_epoch == HELD
    rows = _rows(held, range(HELD))
    model = AutoModelForCausalLM.from_pretrained(c.run_dir, dtype=torch.float32)
    theirs = {"eval_loss": _trainer_loss(model, rows, c.batch, str(tmp_path / "trainer"))}
    assert float(logged["eval_loss"]) == pytest.approx(theirs["eval_loss"], rel=1e-5)
    assert float(logged["eval_perplexity"]) == pytest.approx(math.exp(theirs["eval_loss"]), rel=1e-5)

    # Over all the held-out tokens at once, or over the batches' means unweighted, the figure is another.
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            n = int((row["labels"][1:] != packing.IGNORE).sum())
            total += model.eval()(**{k: v[None] for k, v in row.items()}).loss.item() * n
            count += n
    assert abs(total / count - theirs["eval_loss"]) > 1e-3 * theirs["eval_loss"]
    means = []
    with torch.no_grad():
        for start in range(0, HELD, c.batch):
            part = {k: torch.stack([r[k] for r in rows[start:start + c.batch]]) for k in rows[0]}
            means.append(model(**part).loss.item())
    assert abs(sum(means) / len(means) - theirs["eval_loss"]) > 1e-3 * theirs["eval_loss"]


@pytest.mark.parametrize("eval_batch", [3, pytest.param(1, marks=pytest.mark.slow)])
def test_per_device_eval_batch_size_groups_the_held_out_rows_as_the_trainer_does(tmp_path, eval_batch):
    """Micro-batches of 2 rows, eval batches of 3 (2 rows and 1 of the next micro-batch, then the
    rest) or of 1: each eval batch's mean over its tokens, weighted by its rows, as Trainer.evaluate
    averages at that per_device_eval_batch_size; the figure at batch's size is another."""
    from transformers import AutoModelForCausalLM
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                            data=[files.chats(str(tmp_path / "chats.jsonl"))],
                            eval=[files.chats(str(tmp_path / "held.jsonl"), n=HELD)], seq=64, steps=2, lr=1e-2,
                            per_device_train_batch_size=2, per_device_eval_batch_size=eval_batch, schedule="constant",
                            device="cpu", run_dir=str(tmp_path / "run"), eval_every=2, export_dtype="float32"), [])
    assert (c.batch, c.eval_batch) == (2, eval_batch)
    run(c)
    logged = float(log.read(os.path.join(c.run_dir, "log.csv"))[-1]["eval_loss"])
    _, held = finetune_runs.rows(c, tmp_path, c.seq)
    rows = _rows(held, range(HELD))
    model = AutoModelForCausalLM.from_pretrained(c.run_dir, dtype=torch.float32)
    theirs = _trainer_loss(model, rows, eval_batch, str(tmp_path / "trainer"))
    assert logged == pytest.approx(theirs, rel=1e-5)
    at_batch = _trainer_loss(model, rows, c.batch, str(tmp_path / "at_batch"))
    assert abs(at_batch - theirs) > 1e-3 * theirs


def test_eval_on_each_dataset_evaluates_each_held_out_file_as_the_trainer_does_each(tmp_path):
    """LlamaFactory's eval_on_each_dataset: each eval file's loss on its own (eval_NAME_loss, as the
    Trainer names an evaluation dataset's), beside the loss over all of them; the best model may be
    judged by one of them."""
    from transformers import AutoModelForCausalLM
    first, second = files.chats(str(tmp_path / "first.jsonl"), n=HELD), files.chats(str(tmp_path / "second.jsonl"), n=3)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                            data=[files.chats(str(tmp_path / "chats.jsonl"))], eval=[first, second], seq=64, batch=2,
                            steps=2, lr=1e-2, schedule="constant", device="cpu", run_dir=str(tmp_path / "run"),
                            eval_every=1, save_every=1, eval_on_each_dataset=True, load_best_model_at_end=True,
                            metric_for_best_model="eval_second_loss", export_dtype="float32"), [])
    run(c)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert all(row["eval_first_loss"] and row["eval_second_loss"] and row["eval_loss"] for row in logged)
    best = min(logged, key=lambda row: float(row["eval_second_loss"]))
    _, held = finetune_runs.rows(c, tmp_path, c.seq)
    model = AutoModelForCausalLM.from_pretrained(c.run_dir, dtype=torch.float32)     # the best step's weights
    for name, docs in (("first", range(HELD)), ("second", range(HELD, HELD + 3))):
        theirs = _trainer_loss(model, _rows(held, docs), c.batch, str(tmp_path / name))
        assert float(best[f"eval_{name}_loss"]) == pytest.approx(theirs, rel=1e-5)
        assert float(best[f"eval_{name}_perplexity"]) == pytest.approx(math.exp(theirs), rel=1e-5)
    whole = _trainer_loss(model, _rows(held, range(HELD + 3)), c.batch, str(tmp_path / "all"))
    assert float(best["eval_loss"]) == pytest.approx(whole, rel=1e-5)


def test_eval_on_each_dataset_needs_held_out_files(tmp_path):
    from megacompile.errors import ArgumentError
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    with pytest.raises(ArgumentError, match="give the held-out data as files"):
        load(files.run_yaml(str(tmp_path / "r.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                            data=[chats], eval_fraction=0.2, steps=1, eval_on_each_dataset=True), [])
