"""Resume is exact, and a checkpoint that does not fit leaves the engine as it was."""
from __future__ import annotations

import os

import pytest
import torch

import megacompile
from tests import models
from tests.e2e.harness import clone


def _batches(n):
    return [models.batch(96, 2, 16, seed=i) for i in range(n)]


def _engine(model):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=1e-3, max_grad_norm=1.0))


def test_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=3, dropout=0.1)
    batches = _batches(6)
    straight = _engine(clone(model))
    first = _engine(clone(model))
    torch.manual_seed(7)
    for ids in batches[:3]:
        straight.step(idx=ids, targets=ids)
    torch.manual_seed(7)
    for ids in batches[:3]:
        first.step(idx=ids, targets=ids)
    path = str(tmp_path / "ckpt.pt")
    first.save_checkpoint(path)
    expected = [straight.step(idx=ids, targets=ids) for ids in batches[3:]]
    resumed = _engine(clone(model))
    resumed.prepare(idx=batches[0], targets=batches[0])
    resumed.load_checkpoint(path)        # also restores the random state the saved run had
    got = [resumed.step(idx=ids, targets=ids) for ids in batches[3:]]
    assert got == expected                       # dropout masks, moments, step count: all carried over
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    small = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    small.step(idx=_batches(1)[0], targets=_batches(1)[0])
    path = str(tmp_path / "small.pt")
    small.save_checkpoint(path)
    other = _engine(models.NanoGPT(vocab=96, d=64, layers=2))
    other.step(idx=_batches(1)[0], targets=_batches(1)[0])
    before = other.state_dict()
    with pytest.raises(megacompile.MegacompileError, match="does not match this model.*nothing was loaded"):
        other.load_checkpoint(path)
    for name, value in other.state_dict().items():
        assert torch.equal(value, before[name])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(megacompile.MegacompileError, match="cannot read the checkpoint"):
        other.load_checkpoint(str(tmp_path / "junk.pt"))


def test_saving_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    engine = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    engine.step(idx=_batches(1)[0], targets=_batches(1)[0])
    path = str(tmp_path / "ckpt.pt")
    engine.save_checkpoint(path)
    good = open(path, "rb").read()

    def crash(obj, f, *a, **k):
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(path)
    assert open(path, "rb").read() == good            # the previous checkpoint is intact
    assert os.listdir(tmp_path) == ["ckpt.pt"]          # and no temporary file is left
