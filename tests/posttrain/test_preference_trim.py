"""Stages dpo, kto and rm cut each step's rows after the last token any of them needs (its longest
completion; the token a reward model scores), to seq/8, seq/4, seq/2 or seq as stage sft cuts its
rows (data/trim.py): the step's micro-batches at one length, its KL rows, the moving reference's
pass (sync_ref_model), the reference table and the evaluations too. Short pairs in rows of a long
seq log the losses, rewards and held-out figures of whole rows (trim_padding: false); rows with
images and retrace: false stay whole."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from megacompile.posttrain import IGNORE
from megacompile.train.data import trim
from tests.posttrain import image_pair_files, stage_files
from tests.posttrain.test_image_pairs import _stage as image_stage
from tests.train import files

SEQ = 128       # the pairs are a few words each: a tenth of the row or less
FIGURES = {"dpo": ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy"),
           "kto": ("loss", "rewards_chosen", "rewards_rejected", "kl"),
           "rm": ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")}


def _run(tmp_path, monkeypatch, name: str, stage: str, **more) -> tuple[list[dict], dict[str, list[int]]]:
    """The run's log rows and the widths of the input_ids the engines were handed: by step(), by
    their forward-only passes (the reference table, the KL rows, the moving reference, evaluations)."""
    work = stage_files.workspace(tmp_path / name)
    with open(work["pairs"], "a") as f:     # one long prompt: the steps that draw it need longer rows
        f.write(json.dumps({"prompt": " ".join(files.SENTENCES[:4]), "chosen": files.SENTENCES[4],
                            "rejected": files.SENTENCES[5]}) + "\n")
    settings = stage_files.dpo(work, str(tmp_path / name / "run"), stage=stage, seq=SEQ, grad_accum=2, steps=3,
                               lr=1e-2 if stage != "rm" else 1e-3, **more)
    return stage_files.run_counting_widths(monkeypatch, settings, str(tmp_path / f"{name}.yaml"),
                                           str(tmp_path / name / "run"))


def _same_figures(cut: list[dict], whole: list[dict], stage: str) -> None:
    """Every logged figure of the stage, held-out ones included, the same as whole rows log it (to
    float32 rounding: the products run over fewer columns)."""
    assert len(cut) == len(whole) == 3
    figures = FIGURES[stage] + tuple(f"eval_{f}" for f in FIGURES[stage])
    assert any(r.get("eval_loss") for r in whole)
    for s, (a, b) in enumerate(zip(cut, whole)):
        for figure in figures:
            if b.get(figure):
                assert float(a[figure]) == pytest.approx(float(b[figure]), rel=1e-6, abs=1e-6, nan_ok=True), \
                    (s, figure)


@pytest.mark.filterwarnings("error::megacompile.errors.RetraceWarning")      # the run's own few lengths
@pytest.mark.parametrize("stage,more", [("dpo", {}), ("kto", {}), ("rm", {}),
                                        ("dpo", {"sync_ref_model": True, "ref_model_sync_steps": 1})],
                         ids=["dpo", "kto", "rm", "dpo-sync_ref_model"])
def test_short_pairs_in_long_rows_train_on_cut_rows_as_on_whole_ones(tmp_path, monkeypatch, stage, more):
    whole, whole_widths = _run(tmp_path, monkeypatch, "whole", stage, trim_padding=False, **more)
    cut, widths = _run(tmp_path, monkeypatch, "cut", stage, **more)
    _same_figures(cut, whole, stage)
    assert set(whole_widths["step"]) == {SEQ}
    lengths = {SEQ // 8, SEQ // 4, SEQ // 2, SEQ}
    # every step's rows cut (the planner's first inputs, at seq, are no step's), to the step's longest
    assert len(widths["step"]) == len(whole_widths["step"]) and max(widths["step"]) <= SEQ // 2
    assert set(widths["step"]) <= lengths
    for a, b in zip(widths["step"][::2], widths["step"][1::2]):
        assert a == b       # a step's micro-batches at one length: one program
    # the forward-only passes: the reference table, evaluations, the KL rows and the moving reference
    assert len(widths["forward"]) == len(whole_widths["forward"]) > 0
    assert max(widths["forward"]) <= SEQ // 2 and set(widths["forward"]) <= lengths
    assert len(set(widths["step"] + widths["forward"])) > 1     # the long prompt's rows are longer than the others


def test_retrace_false_keeps_every_row_whole(tmp_path, monkeypatch):
    _, widths = _run(tmp_path, monkeypatch, "fixed", "dpo", retrace=False)
    assert set(widths["step"]) == set(widths["forward"]) == {SEQ}


def test_the_columns_needed_are_the_last_targets_or_the_scored_tokens():
    labels = torch.full((3, 64), IGNORE)
    labels[0, 4:9] = 1          # targets at positions 4 .. 8: columns 0 .. 8 read
    labels[1, 20:30] = 1
    ids = torch.zeros(3, 64, dtype=torch.long)
    assert trim.needed({"input_ids": ids, "labels": labels}) == 30
    assert trim.needed({"input_ids": ids, "labels": torch.full((3, 64), IGNORE)}) == 1
    assert trim.needed({"input_ids": ids, "last": torch.tensor([3, 40, 0]), "margin": torch.zeros(1)}) == 41
    short = torch.full((3, 64), IGNORE)
    short[2, :5] = 1
    cut = trim.together([{"input_ids": ids, "labels": labels}, {"input_ids": ids, "labels": short}])
    assert [b["input_ids"].shape[1] for b in cut] == [32, 32]      # one length for both: seq/2 holds 30
    assert torch.equal(cut[0]["labels"], labels[:, :32])
    scored = trim.together([{"input_ids": ids, "last": torch.tensor([3, 40, 0]), "margin": torch.ones(1)}])[0]
    assert scored["input_ids"].shape == (3, 64) and scored["margin"].tolist() == [1.0]
    assert trim.together([{"input_ids": ids, "labels": labels}], on=False)[0]["input_ids"].shape[1] == 64


class _Recorded:
    """An engine that records the widths its step() is handed and gives each row a log-probability of 0."""
    grad_accum, accumulated_outputs = 1, []

    def __init__(self):
        self.widths: list[int] = []

    def step(self, **inputs):
        self.widths.append(inputs["input_ids"].shape[1])
        self.last_step = SimpleNamespace(tokens=inputs["input_ids"].numel(), skipped=None)
        self.last_outputs = {"logps": torch.zeros(inputs["input_ids"].shape[0])}
        return 0.0


def test_pairs_with_images_keep_whole_rows_and_text_pairs_beside_them_are_cut(tmp_path):
    """A tiny Qwen2.5-VL's pairs (every third record text alone): the micro-batch of a pair with an
    image keeps rows of seq (its pixel inputs are laid out for them); a text pair's is cut."""
    image_pair_files.rlhf_v(str(tmp_path / "data"), n=6)
    stage = image_stage(tmp_path, seq=SEQ, batch=1, grad_accum=1, disable_shuffling=True)
    assert [bool(p.media) for p in stage.pairs] == [True, True, False, True, True, False]
    stage.table = torch.zeros(len(stage.pairs), 2)
    engine = _Recorded()
    stage.step(engine, 0)           # a pair with an image
    stage.step(engine, 2)           # a text pair
    assert engine.widths == [SEQ, SEQ // 8]
