"""compute_accuracy: the held-out token accuracy beside the loss, as LlamaFactory's ComputeAccuracy
computes it (each row's share of target tokens its argmax predicts, averaged over the rows),
checked against eager transformers on the exported model; a metric load_best_model_at_end can
judge by (higher is better); refused where there are no logits or no held-out data."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs


def _settings(tmp_path, **extra) -> dict:
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    return dict(model=files.model_dir(str(tmp_path / "llama"), dim=32), data=[chats], eval=[chats], eval_batches=2,
                seq=32, batch=2, steps=2, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu",
                run_dir=str(tmp_path / "run"), log_every=1, eval_every=2, export_dtype="float32",
                compute_accuracy=True) | extra


def _llamafactory_accuracy(logits: np.ndarray, labels: np.ndarray) -> list[float]:
    """LlamaFactory's ComputeAccuracy over one batch (its numpy, written out here)."""
    preds = np.argmax(logits, axis=-1)
    scores = []
    for i in range(len(preds)):
        pred, label = preds[i, :-1], labels[i, 1:]
        mask = label != packing.IGNORE
        if mask.any():
            scores.append(float(np.mean(pred[mask] == label[mask])))
    return scores


def test_the_held_out_accuracy_is_llamafactorys_of_the_trained_model(tmp_path):
    from transformers import AutoModelForCausalLM
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, load_best_model_at_end=True,
                                                                   metric_for_best_model="accuracy")), [])
    assert c.metric_for_best_model == "eval_accuracy" and c.greater_is_better is True
    run(c)
    logged = log.read(os.path.join(c.run_dir, "log.csv"))
    assert "eval_accuracy" in logged[-1] and logged[-1]["eval_accuracy"] != ""
    _, eval_rows = finetune_runs.rows(c, tmp_path, c.seq)
    model = AutoModelForCausalLM.from_pretrained(c.run_dir, dtype=torch.float32).eval()
    scores = []
    with torch.no_grad():
        for i in range(c.eval_batches):
            inputs = packing.batch(eval_rows, i * c.batch, c.batch, shifted=False)
            scores += _llamafactory_accuracy(model(**inputs).logits.numpy(), inputs["labels"].numpy())
    assert float(logged[-1]["eval_accuracy"]) == pytest.approx(float(np.mean(scores)), abs=1e-6)
    assert 0.0 < float(np.mean(scores)) < 1.0


@pytest.mark.parametrize("extra, says", [
    (dict(eval=None), "compute_accuracy is LlamaFactory's held-out token accuracy"),
    (dict(model="bundled"), "the bundled model"),
    (dict(loss_type="dft"), "loss_type dft"),
])
def test_where_there_are_no_logits_or_no_held_out_data_it_is_refused(tmp_path, extra, says):
    settings = _settings(tmp_path, **extra)
    if extra.get("eval", True) is None:
        del settings["eval_every"]
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    assert says in str(e.value)
