"""A checkpoint records which parameters AdamW's no_decay exempted from weight decay: a load into
an engine that exempts others is refused naming them (strict=False keeps the engine's, with a
warning), as it is for the other optimizer settings; a manifest without the record still loads."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import megacompile
from tests import models
from tests.e2e.harness import clone


def _engine(model, no_decay):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=1e-3, weight_decay=0.1, no_decay=no_decay))


def _saved(tmp_path, model, no_decay) -> str:
    engine = _engine(clone(model), no_decay)
    ids = models.batch(96, 2, 16, seed=0)
    engine.step(idx=ids, targets=ids)
    path = str(tmp_path / "ck")
    engine.save_checkpoint(path)
    engine.close()
    return path


def _biases(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(".bias")]


def test_the_exempt_parameters_are_in_the_manifest_and_a_load_that_changes_them_is_refused(tmp_path):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    exempt = _biases(model)
    assert len(exempt) > 1
    path = _saved(tmp_path, model, exempt)
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["optimizer"]["no_decay"] == sorted(exempt)

    same = _engine(clone(model), list(reversed(exempt)))          # the same set, named in another order
    same.load_checkpoint(path)
    assert same.steps_done == 1

    fewer = _engine(clone(model), exempt[1:])
    with pytest.raises(megacompile.MegacompileError,
                       match=rf"no_decay: the checkpoint's run stepped {len(exempt)} parameters with weight decay 0, "
                             rf"this engine {len(exempt) - 1} \(decayed now: {exempt[0]}\)"):
        fewer.load_checkpoint(path)
    assert fewer.steps_done == 0
    with pytest.warns(RuntimeWarning, match=r"other parameters exempt from weight decay, this engine's AdamW no_decay "
                                            rf"is kept: .*decayed now: {exempt[0]}"):
        fewer.load_checkpoint(path, strict=False)
    assert fewer.steps_done == 1 and fewer.state.no_decay == frozenset(exempt[1:])


def test_a_checkpoint_that_predates_the_record_loads_as_before(tmp_path):
    from megacompile.io.checkpoint import commit
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    path = _saved(tmp_path, model, _biases(model))
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    del manifest["optimizer"]["no_decay"]
    earlier = str(tmp_path / "earlier")
    shutil.copytree(path, earlier + ".partial")
    commit(earlier + ".partial", earlier, manifest)         # the manifest as a save of before wrote it, signed
    other = _engine(clone(model), [])
    other.load_checkpoint(earlier)
    assert other.steps_done == 1
