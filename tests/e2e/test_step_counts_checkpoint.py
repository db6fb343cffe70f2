"""Per-parameter AdamW step counts across a checkpoint: a LLaVA's vision tower, skipped by a
text-only step, resumes with its own count (and, saved between the micro-batches of a step, with
the step's gradient sums only where a saved micro-batch reached); a checkpoint written before
the counts existed loads with every count the global step."""
from __future__ import annotations

import json

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import BETAS, EPS, LR, WD
from megacompile.io import durable
from tests.e2e.harness import clone
from tests.e2e.test_step_without_gradient import text_only
from tests.vlm import batch, llava


def _engine(model, grad_accum: int = 1):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=grad_accum,
                               optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))


def _assert_same(a, b) -> None:
    ours, theirs = a.state_dict(), b.state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in ours.items():
        assert torch.equal(t, theirs[name]), name


# Loaded into an engine whose host state exists (a step ran) and into a fresh one: the slow tier's.
@pytest.mark.parametrize("loaded_before_a_step", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_counts_come_back_on_resume(tmp_path, loaded_before_a_step):
    model = llava()
    micro_batches = [batch(seed=0), text_only(1), batch(seed=2), batch(seed=3)]
    straight = _engine(clone(model))
    for b in micro_batches:
        straight.step(**b)
    first = _engine(clone(model))
    for b in micro_batches[:2]:
        first.step(**b)
    first.save_checkpoint(str(tmp_path / "ck"))
    with open(tmp_path / "ck" / "manifest.json") as f:
        saved = json.load(f)["missed_steps"]
    assert saved == first.state.missed_steps and saved["model.multi_modal_projector.linear_1.weight"] == 1
    resumed = _engine(clone(model))
    if not loaded_before_a_step:       # the host state exists when the checkpoint comes in
        resumed.step(**micro_batches[0])
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.state.missed_steps == saved
    for b in micro_batches[2:]:
        resumed.step(**b)
    _assert_same(resumed, straight)


@pytest.mark.slow     # 18 s; the counts' resume above is the default tier's
def test_a_checkpoint_saved_between_micro_batches_keeps_which_parameters_have_a_sum(tmp_path):
    """Step 2 is text then image: saved after the text micro-batch, the tower's gradient buffer
    holds step 1's sum, which the resumed image micro-batch must not add to."""
    model = llava()
    micro_batches = [batch(seed=0), text_only(1), text_only(2), batch(seed=3)]
    straight = _engine(clone(model), grad_accum=2)
    for b in micro_batches:
        straight.step(**b)
    first = _engine(clone(model), grad_accum=2)
    for b in micro_batches[:3]:
        first.step(**b)
    first.save_checkpoint(str(tmp_path / "ck"))
    with open(tmp_path / "ck" / "manifest.json") as f:
        reached = json.load(f)["step_reached"]
    assert reached and not any("vision_tower" in n for n in reached)
    resumed = _engine(clone(model), grad_accum=2)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    resumed.step(**micro_batches[3])
    _assert_same(resumed, straight)


def test_a_checkpoint_without_counts_loads_with_every_count_the_global_step(tmp_path):
    model = llava()
    engine = _engine(clone(model))
    engine.step(**text_only(0))
    engine.save_checkpoint(str(tmp_path / "ck"))
    assert engine.state.missed_steps
    manifest_path = tmp_path / "ck" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["missed_steps"]                     # as an earlier release wrote it
    manifest_path.write_text(json.dumps(manifest, indent=1))
    (tmp_path / "ck" / "COMMITTED").write_text(durable.sha256_of(str(manifest_path)) + "\n")
    resumed = _engine(clone(model))
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.state.missed_steps == {}
    resumed.step(**batch(seed=1))
    assert resumed.state.missed_steps == {n: 1 for n in resumed.host.slots if "post_layernorm" in n}
