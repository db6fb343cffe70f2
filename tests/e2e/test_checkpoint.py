"""Checkpoint folders: resume is exact on a fresh engine (moments, counters, dropout masks, an
attached torch LR scheduler, the user's extra state), and nothing that is not a complete,
committed checkpoint of this model is ever loaded."""
from __future__ import annotations

import json
import os

import pytest
import torch

import megacompile
from megacompile.errors import WeightsFileError
from tests import models
from tests.e2e.harness import clone


def _batches(n):
    return [models.batch(96, 2, 16, seed=i) for i in range(n)]


def _engine(model, lr=1e-3):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=lr, max_grad_norm=1.0))


def _with_scheduler(engine):
    return torch.optim.lr_scheduler.LambdaLR(engine.torch_optimizer, lambda s: 1.0 / (1 + s))


def _run(engine, scheduler, batches):
    losses = []
    for ids in batches:
        losses.append(engine.step(idx=ids, targets=ids))
        scheduler.step()
    return losses


def test_resume_on_a_fresh_engine_continues_exactly(tmp_path):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=64, layers=3, dropout=0.1)
    batches = _batches(6)
    straight, first = _engine(clone(model)), _engine(clone(model))
    s_straight, s_first = _with_scheduler(straight), _with_scheduler(first)
    torch.manual_seed(7)
    _run(straight, s_straight, batches[:3])
    torch.manual_seed(7)
    _run(first, s_first, batches[:3])
    path = str(tmp_path / "ckpt")
    first.save_checkpoint(path, extra={"data": {"position": 3}})
    expected = _run(straight, s_straight, batches[3:])
    resumed = _engine(clone(model))          # no prepare(): the weights stream in at the first step
    s_resumed = _with_scheduler(resumed)
    torch.manual_seed(123)                   # the random state comes from the checkpoint
    assert resumed.load_checkpoint(path) == {"data": {"position": 3}}
    assert s_resumed.last_epoch == s_first.last_epoch == 3
    got = _run(resumed, s_resumed, batches[3:])
    assert got == expected                   # dropout masks, moments, schedule, step count: carried over
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert sorted(os.listdir(path)) == ["COMMITTED", "buffers.safetensors", "manifest.json"] + sorted(
        f for f in os.listdir(path) if f.startswith("owner-"))


def test_a_checkpoint_of_another_model_is_refused_and_changes_nothing(tmp_path):
    small = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    small.step(idx=_batches(1)[0], targets=_batches(1)[0])
    path = str(tmp_path / "small")
    small.save_checkpoint(path)
    other = _engine(models.NanoGPT(vocab=96, d=64, layers=2))
    other.step(idx=_batches(1)[0], targets=_batches(1)[0])
    before = other.state_dict()
    with pytest.raises(megacompile.MegacompileError, match="does not match this model.*nothing was loaded"):
        other.load_checkpoint(path)
    for name, value in other.state_dict().items():
        assert torch.equal(value, before[name])
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsFileError, match="junk.pt: it is a file, not a checkpoint: pass the folder"):
        other.load_checkpoint(str(tmp_path / "junk.pt"))


def _trained(steps=1):
    engine = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    for ids in _batches(steps):
        engine.step(idx=ids, targets=ids)
    return engine


@pytest.mark.parametrize("keep_last", [1, 3, 4, 6])
def test_keep_last_keeps_that_many_from_the_first_save_on(tmp_path, keep_last):
    engine = _trained()
    for i in range(7):
        engine.save_checkpoint(str(tmp_path / f"step-{i}"), keep_last=keep_last)
        assert sorted(os.listdir(tmp_path)) == [f"step-{j}" for j in range(max(0, i + 1 - keep_last), i + 1)]


@pytest.mark.parametrize("keep_last, left", [pytest.param(1, [1, 6], marks=pytest.mark.slow),
                                             pytest.param(2, [1, 6], marks=pytest.mark.slow), (3, [1, 5, 6])])
def test_a_kept_checkpoint_stays_and_counts_among_keep_last(tmp_path, keep_last, left):
    """transformers' Trainer keeps its best checkpoint beside save_total_limit: with 1, the last and
    the best; with N, the best and the N - 1 latest."""
    engine = _trained()
    for i in range(7):
        engine.save_checkpoint(str(tmp_path / f"step-{i}"), keep_last=keep_last,
                               keep=(str(tmp_path / "step-1"),) if i >= 1 else ())
    assert sorted(os.listdir(tmp_path)) == [f"step-{j}" for j in left]


def test_keep_last_rotates_and_an_uncommitted_one_names_the_last_good(tmp_path):
    engine = _trained()
    for i in range(4):
        engine.save_checkpoint(str(tmp_path / f"step-{i}"), keep_last=2)
        engine.step(idx=_batches(1)[0], targets=_batches(1)[0])
    assert sorted(os.listdir(tmp_path)) == ["step-2", "step-3"]
    os.remove(tmp_path / "step-3" / "COMMITTED")          # as if killed before the marker
    fresh = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    with pytest.raises(WeightsFileError, match=r"step-3: it is not committed.*last committed checkpoint beside it is "
                                               r".*step-2"):
        fresh.load_checkpoint(str(tmp_path / "step-3"))
    assert fresh.host is None and fresh.steps_done == 0 and fresh.state.pending_load is None
    fresh.load_checkpoint(str(tmp_path / "step-2"))
    assert fresh.steps_done == 3


def test_a_corrupted_file_is_refused_before_anything_changes(tmp_path):
    engine = _trained()
    path = tmp_path / "ck"
    engine.save_checkpoint(str(path))
    owner = sorted(f for f in os.listdir(path) if f.startswith("owner-"))[0]
    data = bytearray((path / owner).read_bytes())
    data[-3] ^= 0xFF                                           # one flipped bit in a moment
    (path / owner).write_bytes(bytes(data))
    other = _trained(2)
    before = other.state_dict()
    with pytest.raises(WeightsFileError, match=rf"{owner} does not match its sha256 checksum"):
        other.load_checkpoint(str(path))
    assert other.steps_done == 2
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_other_optimizer_settings_refuse_or_warn_with_strict_false(tmp_path):
    engine = _trained()
    path = str(tmp_path / "ck")
    engine.save_checkpoint(path)
    other = _engine(models.NanoGPT(vocab=96, d=32, layers=2), lr=5e-4)
    with pytest.raises(megacompile.MegacompileError, match=r"lr: the checkpoint has 0.001, this engine 0.0005"):
        other.load_checkpoint(path)
    assert other.steps_done == 0 and other.state.pending_load is None
    with pytest.warns(RuntimeWarning, match=r"this engine's are kept: lr: the checkpoint has 0.001"):
        other.load_checkpoint(path, strict=False)
    assert other.steps_done == 1 and other.torch_optimizer.param_groups[0]["lr"] == 5e-4


def test_a_killed_save_leaves_nothing_a_later_save_does_not_remove(tmp_path):
    engine = _trained()
    dead = tmp_path / ".ck.999999999.partial"                # the pid of no living process
    dead.mkdir()
    (dead / "owner-0000.safetensors").write_bytes(b"half")
    engine.save_checkpoint(str(tmp_path / "ck"))
    assert os.listdir(tmp_path) == ["ck"]
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["steps_done"] == 1 and set(manifest["files"]) == {
        f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors")}


def test_a_replacement_killed_between_its_renames_puts_the_old_checkpoint_back(tmp_path):
    from megacompile.io import durable
    aside = tmp_path / ".ck.999999999.old"          # moved aside by a writer that is gone
    aside.mkdir()
    (aside / "COMMITTED").write_text("x")
    (tmp_path / ".ck.999999999.partial").mkdir()    # its new folder, never renamed into place
    durable.clean_leftovers(str(tmp_path))
    assert os.listdir(tmp_path) == ["ck"] and os.listdir(tmp_path / "ck") == ["COMMITTED"]


def test_planning_after_a_resume_draws_nothing_from_the_random_state(tmp_path, monkeypatch):
    """A fresh engine plans at its first step, after load_checkpoint restored the random state.
    Planning that draws random numbers (the first calibration of the cpu profile does, on a cold
    cache) must not shift the dropout masks: here every plan draws, as a cold cache would."""
    import megacompile.engine.engine as engine_module
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, dropout=0.1)
    batches = _batches(3)
    make_plan = engine_module.make_plan

    def drawing_plan(*args, **kwargs):
        torch.randn(512, 512)
        return make_plan(*args, **kwargs)
    monkeypatch.setattr(engine_module, "make_plan", drawing_plan)
    first = _engine(clone(model))
    s_first = _with_scheduler(first)
    torch.manual_seed(7)
    _run(first, s_first, batches[:1])
    path = str(tmp_path / "ckpt")
    first.save_checkpoint(path)
    expected = _run(first, s_first, batches[1:])
    resumed = _engine(clone(model))
    s_resumed = _with_scheduler(resumed)
    resumed.load_checkpoint(path)
    assert _run(resumed, s_resumed, batches[1:]) == expected


def test_a_checkpoint_saved_before_the_first_step_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, dropout=0.1)
    batches = _batches(2)
    first = _engine(clone(model))
    s_first = _with_scheduler(first)
    path = str(tmp_path / "step-0")
    torch.manual_seed(7)
    first.save_checkpoint(path)                  # no step, no prepare(): from the model's own weights
    assert first.host is None
    expected = _run(first, s_first, batches)
    resumed = _engine(clone(model))
    s_resumed = _with_scheduler(resumed)
    torch.manual_seed(123)
    resumed.load_checkpoint(path)
    assert _run(resumed, s_resumed, batches) == expected
    with torch.device("meta"):
        empty = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    with pytest.raises(megacompile.MegacompileError, match="no weights for .* before saving"):
        empty.save_checkpoint(str(tmp_path / "empty"))
    assert not os.path.exists(str(tmp_path / "empty"))


def _one_file_checkpoint(engine, path):
    """What the one-file format (megacompile-checkpoint/1) held, written as it was."""
    from megacompile.io.legacy_checkpoint import FORMAT
    host = engine.host
    engine.synchronize()
    table = lambda buffer: {n: host.view(buffer, n).clone() for n in host.slots}  # noqa: E731
    torch.save({"format": FORMAT, "masters": table("master"), "exp_avg": table("exp_avg"),
                "exp_avg_sq": table("exp_avg_sq"), "buffers": {n: t.clone() for n, t in host.consts.items()},
                "steps_done": engine.steps_done, "micro_batches": engine.micro_batches, "grad_accum": 1,
                "lr_handle": engine.torch_optimizer.param_groups[0]["lr"], "rng": torch.get_rng_state()}, path)


def test_a_one_file_checkpoint_resumes_on_a_fresh_engine(tmp_path):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, dropout=0.1)
    batches = _batches(3)
    first = _engine(clone(model))
    torch.manual_seed(7)
    first.step(idx=batches[0], targets=batches[0])
    path = str(tmp_path / "old.ckpt.pt")
    _one_file_checkpoint(first, path)
    expected = [first.step(idx=ids, targets=ids) for ids in batches[1:]]
    resumed = _engine(clone(model))
    resumed.load_checkpoint(path)                # no prepare(): the tensors wait for the first step
    assert resumed.host is None and resumed.steps_done == 1
    assert [resumed.step(idx=ids, targets=ids) for ids in batches[1:]] == expected
