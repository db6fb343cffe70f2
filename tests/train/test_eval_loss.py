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


def test_the_held_out_loss_is_what_trainer_evaluate_gives_for_the_trained_model(tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                            data=[files.chats(str(tmp_path / "chats.jsonl"))],
                            eval=[files.chats(str(tmp_path / "held.jsonl"), n=HELD)], seq=64, batch=2, steps=2,
                            lr=1e-2, schedule="constant", device="cpu", run_dir=str(tmp_path / "run"), eval_every=2,
                            export_dtype="float32"), [])
    run(c)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))[-1]
    _, held = finetune_runs.rows(c, tmp_path, c.seq)
    assert held.rows_per_epoch == HELD
    rows = [{k: v[0] for k, v in packing.batch(held, i, 1, shifted=False).items()} for i in range(HELD)]
    model = AutoModelForCausalLM.from_pretrained(c.run_dir, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=c.batch, report_to=[],
                             use_cpu=True)
    theirs = Trainer(model=model, args=args, eval_dataset=rows, data_collator=default_data_collator).evaluate()
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
