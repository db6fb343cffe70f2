"""The bad inputs of weights in and out, each answered by megacompile's own error naming the
file, the tensor or the path, with nothing loaded and nothing half-written. CASES is the
catalogue; docs/errors.md ("Weights in and out") holds it as a table, one row per case."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

import pytest
import safetensors.torch
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import ArgumentError, CheckpointError, MegacompileError, WeightsFileError
from tests import models

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")
IDS = models.batch(96, 2, 16)


def _llama(d=32):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class World:
    """A sharded model folder, a trained engine and a committed checkpoint of it, in `tmp`."""

    def __init__(self, tmp: str):
        self.tmp = tmp
        self.model_dir = os.path.join(tmp, "model")
        _llama().save_pretrained(self.model_dir, max_shard_size="20KB")
        self.engine = megacompile.from_pretrained(self.model_dir, 1.0, device="cpu")
        self.engine.step(input_ids=IDS, labels=IDS)
        self.ckpt = os.path.join(tmp, "ckpts", "step-1")
        self.engine.save_checkpoint(self.ckpt)

    def shards(self, folder=None) -> list[str]:
        folder = folder or self.model_dir
        return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))

    def copy(self, what: str) -> str:
        target = os.path.join(self.tmp, f"copy-{len(os.listdir(self.tmp))}", os.path.basename(what))
        shutil.copytree(what, target)
        return target

    def load_model(self, folder: str):
        return megacompile.from_pretrained(folder, 1.0, device="cpu")

    def fresh_engine(self):
        return megacompile.from_pretrained(self.model_dir, 1.0, device="cpu")


def _missing_shard(w):
    folder = w.copy(w.model_dir)
    os.remove(w.shards(folder)[1])
    w.load_model(folder)


def _truncated_shard(w):
    folder = w.copy(w.model_dir)
    shard = w.shards(folder)[-1]
    os.truncate(shard, os.path.getsize(shard) - 100)
    w.load_model(folder)


def _wrong_model(w):
    folder = os.path.join(w.tmp, "wider")
    _llama(d=64).save_pretrained(folder)
    with open(os.path.join(w.model_dir, "config.json")) as f:
        config = f.read()
    with open(os.path.join(folder, "config.json"), "w") as f:
        f.write(config)                         # the small model's config, the wide model's weights
    w.load_model(folder)


def _foreign_tensor(w):
    folder = w.copy(w.model_dir)
    safetensors.torch.save_file({"vision.proj.weight": torch.zeros(2, 2)}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"]["vision.proj.weight"] = "model.safetensors"
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    w.load_model(folder)


def _missing_tensor(w):
    folder = w.copy(w.model_dir)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    del index["weight_map"]["model.norm.weight"]      # the index no longer places it in any shard
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    w.load_model(folder)


def _no_config(w):
    folder = w.copy(w.model_dir)
    os.remove(os.path.join(folder, "config.json"))
    w.load_model(folder)


def _no_weights(w):
    folder = os.path.join(w.tmp, "config-only")
    os.makedirs(folder)
    shutil.copy(os.path.join(w.model_dir, "config.json"), folder)
    w.load_model(folder)


def _checksum_mismatch(w):
    ckpt = os.path.join(os.path.dirname(w.ckpt), "step-2")
    shutil.copytree(w.ckpt, ckpt)
    owner = sorted(f for f in os.listdir(ckpt) if f.startswith("owner-"))[0]
    with open(os.path.join(ckpt, owner), "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03\x04")
    w.engine.load_checkpoint(ckpt)


def _truncated_checkpoint(w):
    ckpt = w.copy(w.ckpt)
    os.truncate(os.path.join(ckpt, "buffers.safetensors"), 10)
    w.engine.load_checkpoint(ckpt)


def _uncommitted(w):
    ckpt = os.path.join(os.path.dirname(w.ckpt), "step-2")
    shutil.copytree(w.ckpt, ckpt)
    os.remove(os.path.join(ckpt, "COMMITTED"))
    w.engine.load_checkpoint(ckpt)


def _other_model_checkpoint(w):
    other = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), 1.0, device="cpu")
    other.load_checkpoint(w.ckpt)


def _failing_writer(what):
    def act(w):
        def fail(*a, **k):
            raise OSError(28, "No space left on device")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(safetensors.torch, "save_file", fail)
            mp.setattr("megacompile.io.hf_save._write_shard", fail)
            if what == "checkpoint":
                w.engine.save_checkpoint(os.path.join(w.tmp, "full", "ck"))
            else:
                w.engine.save_pretrained(os.path.join(w.tmp, "full", "export"))
    return act


def _mounted(options: str, w) -> str:
    folder = os.path.join(w.tmp, f"mnt-{options.replace(',', '-')}")
    os.makedirs(folder)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", folder], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs privileges this machine does not give")
    w.mounts.append(folder)
    return folder


def _disk_full(w):
    w.engine.save_checkpoint(os.path.join(_mounted("size=64k", w), "ck"))


def _read_only(w):
    w.engine.save_checkpoint(os.path.join(_mounted("ro,size=64k", w), "ck"))


def _not_json_extra(w):
    w.engine.save_checkpoint(os.path.join(w.tmp, "x"), extra={"ids": IDS})


def _export_there(w):
    """Into a folder that holds an export (its config, shards and index) and the user's README:
    refused, naming the files, and nothing in it changes."""
    folder = w.copy(w.model_dir)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("# card\n")
    before = {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}
    try:
        w.engine.save_pretrained(folder)
    finally:
        assert {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)} == before


@dataclass
class Case:
    id: str
    error: type
    match: str
    act: Callable


CASES = [
    Case("from_pretrained: missing shard", WeightsFileError, r"the shard .*model-00002-of-\d+\.safetensors is missing.*"
         r"places \d+ tensors in it \(model\.", _missing_shard),
    Case("from_pretrained: truncated shard", WeightsFileError, r"model-\d+-of-\d+\.safetensors is truncated: \S+ needs "
         r"bytes up to \d+, the file has \d+", _truncated_shard),
    Case("from_pretrained: weights of another model", WeightsFileError, r"model\.safetensors: \S+ has shape "
         r"\(96, 64\), the model built from config\.json has \(96, 32\)", _wrong_model),
    Case("from_pretrained: a tensor the model has no place for", WeightsFileError,
         r"model\.safetensors holds vision\.proj\.weight, which the LlamaForCausalLM .* has no place for",
         _foreign_tensor),
    Case("from_pretrained: a parameter missing", WeightsFileError,
         r"lack 1 tensors of the model \(model\.norm\.weight\)",
         _missing_tensor),
    Case("from_pretrained: no config.json", WeightsFileError, r"has no config\.json", _no_config),
    Case("from_pretrained: no safetensors", WeightsFileError, r"has neither model\.safetensors nor", _no_weights),
    Case("load_checkpoint: checksum mismatch", WeightsFileError, r"owner-\d+\.safetensors does not match its sha256 "
         r"checksum \(corrupted\); nothing was loaded; the last committed checkpoint beside it is .*step-1",
         _checksum_mismatch),
    Case("load_checkpoint: truncated file", WeightsFileError, r"buffers\.safetensors has 10 bytes, the manifest says",
         _truncated_checkpoint),
    Case("load_checkpoint: uncommitted", WeightsFileError, r"step-2: it is not committed .*the last committed "
         r"checkpoint beside it is .*step-1", _uncommitted),
    Case("load_checkpoint: another model", MegacompileError, r"does not match this model: .*nothing was loaded",
         _other_model_checkpoint),
    Case("save_checkpoint: failing writer", CheckpointError, r"full/ck: the disk is full .*nothing was written",
         _failing_writer("checkpoint")),
    Case("save_pretrained: failing writer", CheckpointError, r"full/export: the disk is full .*nothing was written",
         _failing_writer("export")),
    Case("save_checkpoint: disk full (64 KiB tmpfs)", CheckpointError, r"ck: the disk is full", _disk_full),
    Case("save_checkpoint: unwritable folder (read-only tmpfs)", CheckpointError, r"is not writable", _read_only),
    Case("save_checkpoint: extra is not JSON", CheckpointError, r"extra=.*must be JSON", _not_json_extra),
    Case("save_pretrained: max_shard_size='5 apples'", ArgumentError, r"max_shard_size.*'5 apples'",
         lambda w: w.engine.save_pretrained(os.path.join(w.tmp, "e"), max_shard_size="5 apples")),
    Case("save_checkpoint: keep_last=0", CheckpointError, r"keep_last.*got 0",
         lambda w: w.engine.save_checkpoint(os.path.join(w.tmp, "k"), keep_last=0)),
    Case("save_pretrained: a folder holding an export", CheckpointError,
         r"holds a model export whose files would be replaced or removed \(config\.json, .*model-00001-of-\d+"
         r"\.safetensors.*\); pass overwrite=True to replace them \(the folder's other files are kept", _export_there),
    Case("save_pretrained: overwrite='yes'", ArgumentError, r"overwrite is True or False.*got 'yes'",
         lambda w: w.engine.save_pretrained(os.path.join(w.tmp, "o"), overwrite="yes")),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(str(tmp_path_factory.mktemp("io")))


def _files(folder: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_the_projects_error(case, world):
    world.mounts = []
    state = world.engine.state_dict()
    counters = (world.engine.steps_done, world.engine.micro_batches)
    checkpoints = _files(os.path.dirname(world.ckpt))
    try:
        with pytest.raises(case.error) as info:
            case.act(world)
        assert re.search(case.match, str(info.value)), str(info.value)
        for folder in world.mounts:           # nothing half-written on the full or read-only disk
            assert os.listdir(folder) == []
    finally:
        for folder in world.mounts:
            subprocess.run(["umount", folder], check=False)
    assert (world.engine.steps_done, world.engine.micro_batches) == counters
    assert all(torch.equal(v, state[k]) for k, v in world.engine.state_dict().items())
    assert not [f for f in os.listdir(world.tmp) if f.startswith(".")], "a temporary folder was left"
    assert _files(os.path.dirname(world.ckpt)) - {f for f in _files(os.path.dirname(world.ckpt))
                                                  if f.startswith("step-2")} == checkpoints
    shutil.rmtree(os.path.join(os.path.dirname(world.ckpt), "step-2"), ignore_errors=True)


def test_the_catalogue_is_in_the_docs():
    with open(DOC) as f:
        text = f.read()
    section = text[text.index("## Weights in and out"):]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    documented = {cells[0].strip(): cells[1].strip().strip("`") for cells in rows if len(cells) >= 4}
    assert {c.id: documented.get(c.id) for c in CASES} == {c.id: c.error.__name__ for c in CASES}
