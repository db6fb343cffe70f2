"""What load_checkpoint refuses and what it gives: buffers the model built itself are never replaced
silently, a loaded checkpoint is state before any step, a manifest holds what a save writes, and a
path that is not a checkpoint folder is answered with what to pass instead."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import MegacompileError, WeightsFileError
from megacompile.io import durable
from tests import models

IDS = models.batch(96, 2, 16)
INV_FREQ = "model.rotary_emb.inv_freq"


def _llama(rope_theta: float):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        rope_theta=rope_theta, use_cache=False))


def _engine(model):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu")


def _llama_step(engine):
    return engine.step(input_ids=IDS, labels=IDS)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A checkpoint of a Llama with rope_theta=1e4, after one step."""
    path = str(tmp_path_factory.mktemp("rope") / "ck")
    engine = _engine(_llama(1e4))
    _llama_step(engine)
    engine.save_checkpoint(path)
    return path


def test_a_checkpoint_of_another_rope_theta_is_refused_naming_the_buffer(llama_checkpoint):
    model = _llama(1e6)
    engine = _engine(model)
    with pytest.raises(MegacompileError, match=rf"buffer {INV_FREQ}: the checkpoint has \[1, 0\.1, 0\.01, \.\.\.\] "
                                               rf"\(min 0\.001.*\), the model \[1, 0\.0316228, 0\.001, \.\.\.\].*"
                                               r"nothing was loaded \(strict=False.*rope_theta"):
        engine.load_checkpoint(llama_checkpoint)
    assert engine.steps_done == 0 and engine.state.pending_load is None and engine.host is None


def test_strict_false_keeps_the_models_own_buffers_and_says_which(llama_checkpoint):
    model = _llama(1e6)
    own = model.model.rotary_emb.inv_freq.clone()
    engine = _engine(model)
    with pytest.warns(RuntimeWarning, match=rf"buffers the model built itself; the model's own are kept: {INV_FREQ}"):
        engine.load_checkpoint(llama_checkpoint, strict=False)
    _llama_step(engine)                        # the host state is built from the pending load here
    assert torch.equal(engine.host.consts[INV_FREQ], own)
    assert engine.steps_done == 2


def test_strict_false_on_a_running_engine_keeps_its_buffers(llama_checkpoint):
    model = _llama(1e6)
    own = model.model.rotary_emb.inv_freq.clone()
    engine = _engine(model)
    _llama_step(engine)
    with pytest.warns(RuntimeWarning, match=rf"the model's own are kept: {INV_FREQ}"):
        engine.load_checkpoint(llama_checkpoint, strict=False)
    assert torch.equal(engine.host.consts[INV_FREQ], own)
    assert engine.steps_done == 1


def test_state_dict_right_after_load_checkpoint_is_the_checkpoints(tmp_path):
    trained = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    for _ in range(2):
        trained.step(idx=IDS, targets=IDS)
    trained.save_checkpoint(str(tmp_path / "ck"))
    fresh = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    fresh.load_checkpoint(str(tmp_path / "ck"))
    got, expected = fresh.state_dict(), trained.state_dict()
    assert fresh.host is None and got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def _resign(path: str, edit) -> None:
    """Change the manifest as a hand would, and re-sign it so that every checksum holds."""
    manifest_path = os.path.join(path, "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(path, "COMMITTED"), "w") as f:
        f.write(durable.sha256_of(manifest_path) + "\n")


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(steps_done="3"), r"steps_done: expected an int >= 0, found str '3'"),
    (lambda m: m.update(micro_batches=-1), r"micro_batches: expected an int >= 0, found int -1"),
    (lambda m: m.update(skipped_steps=1.5), r"skipped_steps: expected an int >= 0, found float 1.5"),
    (lambda m: m["optimizer"].update(grad_accum=0), r"optimizer.grad_accum: expected an int >= 1, found int 0"),
    (lambda m: m["optimizer"].update(betas=[0.9]), r"optimizer.betas: expected a list of two numbers in \[0, 1\)"),
    (lambda m: m.pop("rng"), r"rng: missing"),
    (lambda m: m["rng"].update(cpu="AAAA"), r"rng.cpu: expected a CPU random state \(\d+ bytes in base64\)"),
    (lambda m: m["files"].update({"../outside": {"bytes": 0, "sha256": ""}}),
     r"files: expected a file name inside the checkpoint folder, found '../outside'"),
], ids=["steps_done", "micro_batches", "skipped_steps", "grad_accum", "betas", "rng", "rng_cpu", "file_name"])
def test_a_manifest_field_of_the_wrong_type_is_refused_naming_it(tmp_path, edit, message):
    engine = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    engine.step(idx=IDS, targets=IDS)
    path = str(tmp_path / "ck")
    engine.save_checkpoint(path)
    _resign(path, edit)
    other = _engine(models.NanoGPT(vocab=96, d=32, layers=2))
    with pytest.raises(WeightsFileError, match=r"its manifest.json does not hold what a save writes: " + message):
        other.load_checkpoint(path)
    assert other.steps_done == 0 and other.state.pending_load is None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint and a Hugging Face export of one trained engine."""
    root = tmp_path_factory.mktemp("saved")
    engine = _engine(_llama(1e4))
    _llama_step(engine)
    engine.save_checkpoint(str(root / "ck"))
    engine.save_pretrained(str(root / "hf"))
    return root


@pytest.mark.parametrize("given, message", [
    ("ck/manifest.json", r"it is the file manifest.json of a checkpoint: pass the checkpoint folder, "
                         r"load_checkpoint\('.*ck'\)"),
    ("ck/COMMITTED", r"it is the file COMMITTED of a checkpoint: pass the checkpoint folder"),
    ("ck/buffers.safetensors", r"it is the file buffers.safetensors of a checkpoint: pass the checkpoint folder"),
    ("hf", r"it is a Hugging Face model folder, not a checkpoint: load it with megacompile.from_pretrained"),
    ("hf/model.safetensors", r"it is a weights file, not a checkpoint: .*megacompile.from_pretrained\('.*hf'"),
], ids=["manifest", "marker", "shard", "hf_folder", "hf_weights"])
def test_a_path_that_is_not_a_checkpoint_folder_says_what_to_pass(saved, given, message):
    engine = _engine(_llama(1e4))
    with pytest.raises(WeightsFileError, match=r"cannot load the checkpoint .*: " + message):
        engine.load_checkpoint(str(saved / given))
    assert engine.steps_done == 0 and engine.state.pending_load is None


def test_strict_that_is_not_a_bool_is_refused(llama_checkpoint):
    engine = _engine(_llama(1e4))
    with pytest.raises(MegacompileError, match=r"load_checkpoint\(strict=...\) is True .* or False .*; got 'yes'"):
        engine.load_checkpoint(llama_checkpoint, strict="yes")
    assert engine.steps_done == 0 and engine.state.pending_load is None
