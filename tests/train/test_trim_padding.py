"""A step's rows are cut after their longest document, to seq/8, seq/4, seq/2 or seq (data/trim.py):
the losses and gradients are those of rows of seq tokens, every target is kept, and a run meets at
most four shapes; trim_padding: false keeps every row seq tokens long."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megacompile.train import load, log, run
from megacompile.train.data import trim
from tests.train import files

SEQ, BATCH, ACCUM = 128, 2, 2


def _chats(path: str) -> str:
    """Conversations of one to six exchanges: rows filled to several lengths."""
    with open(path, "w") as f:
        for i in range(60):
            turns = []
            for k in range(1 + (i * 7) % 6):
                turns += [{"role": "user", "content": files.SENTENCES[(i + k) % len(files.SENTENCES)]},
                          {"role": "assistant", "content": files.SENTENCES[(i + 2 * k + 1) % len(files.SENTENCES)]}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _run(tmp_path, name: str, **settings) -> list[dict]:
    chats = _chats(str(tmp_path / "chats.jsonl"))
    model = str(tmp_path / "model")
    if not os.path.isdir(model):
        files.model_dir(model)
    run(load(files.run_yaml(str(tmp_path / f"{name}.yaml"), model=model, data=[chats], seq=SEQ, batch=BATCH,
                            grad_accum=ACCUM, lr=1e-3, device="cpu", run_dir=str(tmp_path / name),
                            **{"steps": 5, **settings}), []))
    return log.read(str(tmp_path / name / "log.csv"))


def test_cut_rows_train_as_whole_ones_do_at_a_few_lengths(tmp_path):
    whole = _run(tmp_path, "whole", trim_padding=False)
    cut = _run(tmp_path, "cut")
    for a, b in zip(cut, whole):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6, abs=0)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-5, abs=0)
    rows = BATCH * ACCUM
    assert {int(r["tokens"]) for r in whole} == {rows * SEQ}
    lengths = {int(r["tokens"]) // rows for r in cut}
    assert lengths <= {SEQ // 8, SEQ // 4, SEQ // 2, SEQ} and len(lengths) >= 2 and min(lengths) < SEQ


def test_the_length_holds_every_document_token_of_the_step():
    assert [trim.length(n, 128) for n in (1, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert trim.length(13, 100) == 13 and trim.length(14, 100) == 25        # seq // 8 rounded up

    class Rows:
        def row(self, i):
            kept = np.zeros(10, dtype=bool)
            kept[:[3, 7, 0][i]] = True
            return None, None, None, kept
    assert trim.filled(Rows(), 0, 3, shifted=False) == 7
    assert trim.filled(Rows(), 0, 3, shifted=True) == 6       # a shifted row's last token is only a target
    ids = torch.arange(20).view(2, 10)
    out = trim.trimmed({"input_ids": ids, "labels": ids, "scale": torch.tensor(2.0)}, 4)
    assert out["input_ids"].tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]] and out["labels"].shape == (2, 4)
    assert out["scale"].item() == 2.0


def test_retrace_false_keeps_every_row_whole(tmp_path):
    rows = _run(tmp_path, "fixed", retrace=False)
    assert {int(r["tokens"]) for r in rows} == {BATCH * ACCUM * SEQ}


def test_the_runs_own_lengths_do_not_warn_of_inputs_that_keep_changing(tmp_path):
    import warnings

    from megacompile.errors import RetraceWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)
        rows = _run(tmp_path, "quiet", steps=12, eval_fraction=0.1, eval_steps=3)
    assert len({int(r["tokens"]) for r in rows if r["tokens"]}) >= 2
