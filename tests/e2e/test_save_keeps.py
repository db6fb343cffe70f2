"""Nothing of the user's is lost on save: save_pretrained writes and replaces only an export's own
files (a README, a LICENSE, a .git/ beside them survive byte for byte) and replaces a previous
export only when asked; keep_last rotates only the checkpoints of the run that saves; a checkpoint
replaced at a fixed path is loadable at every instant of the replacement (the kills themselves:
test_io_crash.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import CheckpointError
from megacompile.io import durable
from tests import models

IDS = models.batch(96, 2, 16, seed=3)
DEAD = 999999999        # the pid of no living process


# -- save_pretrained -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An engine read from a 6-shard Llama folder with a tokenizer file, trained 2 steps."""
    source = str(tmp_path_factory.mktemp("hf") / "src")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(source, max_shard_size="20KB")
    with open(os.path.join(source, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    engine = megacompile.from_pretrained(source, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    for _ in range(2):
        engine.step(input_ids=IDS, labels=IDS)
    return engine


def _user_files(folder) -> dict[str, bytes]:
    """A clone of a model repository as a user keeps it: a .git/ with files in it, a README, a
    LICENSE, .gitattributes and notes of their own."""
    made = {".git/HEAD": b"ref: refs/heads/main\n", ".git/config": b"[core]\n\tbare = false\n",
            ".git/objects/ab/cdef0123": bytes(range(256)), "README.md": b"# my model\n\nfine-tuned on my data\n",
            "LICENSE": b"Apache License 2.0\n", "notes/eval.txt": b"loss 1.23\n",
            ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}
    for name, data in made.items():
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    return made


def _tree(folder) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder)] = f.read()
    return out


def _weights(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors") or f.endswith(".index.json"))


def test_an_export_goes_beside_the_users_files_and_replaces_only_its_own_when_asked(trained, tmp_path):
    out = tmp_path / "repo"
    mine = _user_files(out)
    trained.save_pretrained(str(out), max_shard_size="20KB")
    tree = _tree(out)
    assert {k: tree[k] for k in mine} == mine                       # every user file, byte for byte
    shards = [f for f in _weights(out) if f.startswith("model-")]
    assert len(shards) >= 3 and "model.safetensors.index.json" in tree
    assert set(tree) == set(mine) | set(_weights(out)) | {"config.json", "generation_config.json",
                                                         "tokenizer_config.json"}
    weights = trained.state_dict()
    back = AutoModelForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(v, weights[k]) for k, v in back.state_dict().items())

    # Again without overwrite: refused before anything is written, naming what would be replaced.
    with pytest.raises(CheckpointError, match=r"holds a model export whose files would be replaced or removed "
                                              r"\(config\.json, generation_config\.json, model-00001-of-.*"
                                              r"overwrite=True.*other files are kept"):
        trained.save_pretrained(str(out), dtype=torch.bfloat16)
    assert _tree(out) == tree

    # With overwrite: one bf16 file replaces the fp32 shards; the stale shards and index go.
    trained.save_pretrained(str(out), dtype=torch.bfloat16, overwrite=True)
    after = _tree(out)
    assert {k: after[k] for k in mine} == mine
    assert _weights(out) == ["model.safetensors"]
    assert sorted(os.listdir(out)) == sorted({".git", ".gitattributes", "LICENSE", "README.md", "notes", "config.json",
                                              "generation_config.json", "tokenizer_config.json", "model.safetensors"})
    half = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert all(torch.equal(v, weights[k].to(torch.bfloat16)) for k, v in half.state_dict().items())

    # And back to shards: the single file goes too (transformers would read it before the index).
    trained.save_pretrained(str(out), max_shard_size="20KB", overwrite=True)
    assert _weights(out) == sorted(shards + ["model.safetensors.index.json"])
    back = AutoModelForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(v, weights[k]) for k, v in back.state_dict().items())
    assert {k: _tree(out)[k] for k in mine} == mine


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_an_export_into_a_real_git_clone_leaves_the_repository_intact(trained, tmp_path):
    repo = str(tmp_path / "clone")
    os.makedirs(repo)
    git = ["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", repo], check=True)
    with open(os.path.join(repo, "README.md"), "w") as f:
        f.write("# a model card\n")
    subprocess.run(git + ["add", "README.md"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "card"], check=True)
    before = _tree(os.path.join(repo, ".git"))
    trained.save_pretrained(repo)
    assert _tree(os.path.join(repo, ".git")) == before
    status = subprocess.run(git + ["status", "--porcelain"], check=True, capture_output=True, text=True).stdout
    assert sorted(line[3:] for line in status.splitlines()) == ["config.json", "generation_config.json",
                                                                "model.safetensors", "tokenizer_config.json"]
    subprocess.run(git + ["fsck", "--no-progress"], check=True, capture_output=True)


def test_a_failed_export_leaves_the_previous_one_whole(trained, tmp_path, monkeypatch):
    from megacompile.io import hf_save
    out = tmp_path / "out"
    mine = _user_files(out)
    trained.save_pretrained(str(out), max_shard_size="20KB")
    tree = _tree(out)
    write = hf_save._write_shard
    calls = []

    def failing(target, shard, dtype):
        calls.append(target)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(target, shard, dtype)
    monkeypatch.setattr(hf_save, "_write_shard", failing)
    with pytest.raises(CheckpointError, match=r"the disk is full.*the previous model folder there is untouched"):
        trained.save_pretrained(str(out), max_shard_size="20KB", overwrite=True)
    assert _tree(out) == tree and {k: tree[k] for k in mine} == mine      # no staging folder left either


class _Killed(BaseException):
    """As a SIGKILL: no handler of the save runs past it (the swap's renames sit outside any)."""


@pytest.mark.parametrize("kill_at", range(1, 18))
def test_an_export_killed_mid_swap_is_finished_by_the_next_one(trained, tmp_path, monkeypatch, kill_at):
    """A kill at any rename of the swap (the first makes the staged export the decided one, the
    others move the old files aside and the new ones in): every user file is there, and the next
    save_pretrained finds the old export whole (killed before it was decided) or finishes the new."""
    out = tmp_path / "out"
    mine = _user_files(out)
    trained.save_pretrained(str(out), max_shard_size="20KB")
    rename, count = os.rename, [0]

    def dying(src, dst):
        if "/.export." in str(src) + str(dst):
            count[0] += 1
            if count[0] == kill_at:
                raise _Killed()
        rename(src, dst)
    monkeypatch.setattr(durable.os, "rename", dying)
    try:
        trained.save_pretrained(str(out), dtype=torch.bfloat16, overwrite=True)
        assert kill_at == 17, f"the swap took {count[0]} renames: kill at each"     # the last: past them all
    except _Killed:
        pass
    monkeypatch.setattr(durable.os, "rename", rename)
    assert {k: _tree(out)[k] for k in mine} == mine
    with pytest.raises(CheckpointError, match="would be replaced"):     # finishes the swap, then refuses
        trained.save_pretrained(str(out))
    weights = trained.state_dict()
    if kill_at == 1:        # before the staged export was decided: the old one, as it was
        assert len(_weights(out)) > 3
        back = AutoModelForCausalLM.from_pretrained(str(out))
        assert all(torch.equal(v, weights[k]) for k, v in back.state_dict().items())
        return
    assert sorted(os.listdir(out)) == sorted({".git", ".gitattributes", "LICENSE", "README.md", "notes", "config.json",
                                              "generation_config.json", "tokenizer_config.json", "model.safetensors"})
    half = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert all(torch.equal(v, weights[k].to(torch.bfloat16)) for k, v in half.state_dict().items())


def test_a_dead_writers_unfinished_staging_is_removed(tmp_path):
    out = tmp_path / "out"
    mine = _user_files(out)
    staging = out / f".export.{DEAD}.partial"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"half")
    durable.recover_files(str(out))
    assert _tree(out) == mine


# -- keep_last: this run's checkpoints only ----------------------------------------------------

def _engine():
    return megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=1e-3))


def _steps(engine, n):
    for i in range(n):
        ids = models.batch(96, 2, 16, seed=i)
        engine.step(idx=ids, targets=ids)
    return engine


def _run_of(path) -> str:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["run"]


def test_keep_last_rotates_only_the_checkpoints_of_the_run_that_saves(tmp_path):
    a, b = _steps(_engine(), 1), _steps(_engine(), 5)
    assert a.run_id != b.run_id
    b.save_checkpoint(str(tmp_path / "b-5"), keep_last=1)
    a.save_checkpoint(str(tmp_path / "a-1"), keep_last=1)      # step 1 beside step 5: its own new one stays
    assert sorted(os.listdir(tmp_path)) == ["a-1", "b-5"]
    _steps(a, 1).save_checkpoint(str(tmp_path / "a-2"), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["a-2", "b-5"]
    _steps(b, 1).save_checkpoint(str(tmp_path / "b-6"), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["a-2", "b-6"]
    assert _run_of(tmp_path / "a-2") == a.run_id and _run_of(tmp_path / "b-6") == b.run_id

    # A resumed run is the run it resumed: it rotates that run's older checkpoints, and no other's.
    resumed = _engine()
    resumed.load_checkpoint(str(tmp_path / "a-2"))
    assert resumed.run_id == a.run_id
    _steps(resumed, 1).save_checkpoint(str(tmp_path / "a-3"), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["a-3", "b-6"]


def test_keep_last_keeps_the_one_just_written_though_the_run_has_later_steps(tmp_path):
    """A run resumed from an earlier checkpoint writes steps below its own later ones: the one
    just written is never the one removed."""
    engine = _steps(_engine(), 1)
    for i in range(3):
        _steps(engine, 1).save_checkpoint(str(tmp_path / f"s-{i}"), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["s-1", "s-2"]
    back = _engine()
    back.load_checkpoint(str(tmp_path / "s-1"))          # steps 3; s-2 holds step 4
    back.save_checkpoint(str(tmp_path / "again"), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["again"]


def test_checkpoints_written_before_run_ids_are_never_rotated(tmp_path):
    engine = _steps(_engine(), 1)
    engine.save_checkpoint(str(tmp_path / "old"))
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    del manifest["run"]                                   # as the writer of before wrote it
    text = json.dumps(manifest, indent=1)
    (tmp_path / "old" / "manifest.json").write_text(text)
    (tmp_path / "old" / "COMMITTED").write_text(durable.sha256_of(str(tmp_path / "old" / "manifest.json")) + "\n")
    _steps(engine, 1).save_checkpoint(str(tmp_path / "new"), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["new", "old"]


# -- a checkpoint replaced at a fixed path ------------------------------------------------------

def _saved(tmp_path, name, steps):
    engine = _steps(_engine(), steps)
    engine.save_checkpoint(str(tmp_path / name))
    return str(tmp_path / name)


def test_a_checkpoint_is_committed_before_it_takes_the_path(tmp_path, monkeypatch):
    old = _saved(tmp_path, "ck", 1)
    seen = []
    rename = os.rename

    def watching(src, dst):
        seen.append((os.path.basename(src), os.path.basename(dst), durable.committed(src)))
        rename(src, dst)
    monkeypatch.setattr(durable.os, "rename", watching)
    _steps(_engine(), 2).save_checkpoint(old)
    pid = os.getpid()
    assert seen == [("ck", f".ck.{pid}.old", True), (f".ck.{pid}.partial", "ck", True)]
    assert os.listdir(tmp_path) == ["ck"]


def _states(tmp_path):
    """The folder as a writer killed at each point of replacing ck (step 1) by a new one (step 2)
    leaves it: ck (steps_done) expected to load."""
    old, new = _saved(tmp_path, "ck", 1), _saved(tmp_path, "new", 2)
    aside, partial = tmp_path / f".ck.{DEAD}.old", tmp_path / f".ck.{DEAD}.partial"
    yield "before the first rename", 1
    os.rename(new, partial)
    yield "written, committed, not renamed", 1
    os.rename(old, aside)
    yield "between the renames", 1
    os.rename(partial, old)
    yield "after the renames", 2
    for name in sorted(os.listdir(aside))[:2]:
        os.remove(aside / name)
    yield "mid-way through deleting the old one", 2


def test_at_every_point_of_a_replacement_a_committed_checkpoint_loads(tmp_path):
    for i, (moment, steps) in enumerate(_states(tmp_path / "run")):
        case = tmp_path / f"case-{i}"
        shutil.copytree(tmp_path / "run", case)
        engine = _engine()
        engine.load_checkpoint(str(case / "ck"))
        assert engine.steps_done == steps, moment
        assert os.listdir(case) == ["ck"] or sorted(os.listdir(case)) == ["ck", "new"], (moment, os.listdir(case))


def test_a_load_waits_for_a_replacement_under_way(tmp_path):
    """A live writer between its two renames: the load waits for its new checkpoint."""
    old, new = _saved(tmp_path, "ck", 1), _saved(tmp_path, "new", 2)
    writer = subprocess.Popen(["sleep", "30"])       # a living pid: the writer
    try:
        aside = str(tmp_path / f".ck.{writer.pid}.old")
        os.rename(old, aside)
        engine = _engine()      # built first: the writer's 0.3 s run from the load's start, however long this takes
        started = time.monotonic()
        threading.Timer(0.3, lambda: (os.rename(new, old), os.rename(aside, aside + "-gone"))).start()
        engine.load_checkpoint(old)
        assert engine.steps_done == 2 and 0.2 < time.monotonic() - started < 4
    finally:
        writer.kill()
        writer.wait()


def test_a_load_takes_back_the_checkpoint_of_a_writer_that_never_finishes(tmp_path, monkeypatch):
    old = _saved(tmp_path, "ck", 1)
    writer = subprocess.Popen(["sleep", "30"])       # alive, but its new folder never comes
    try:
        os.rename(old, tmp_path / f".ck.{writer.pid}.old")
        monkeypatch.setattr(durable.settle, "__defaults__", (0.2,))
        engine = _engine()
        engine.load_checkpoint(old)
        assert engine.steps_done == 1 and os.listdir(tmp_path) == ["ck"]
    finally:
        writer.kill()
        writer.wait()


def test_a_writer_of_before_killed_before_its_marker_leaves_the_old_one_to_load(tmp_path):
    """The writer of before committed after its rename: killed in between, an uncommitted folder
    held the path and the old checkpoint lay aside. The load puts the old one back."""
    old, new = _saved(tmp_path, "ck", 1), _saved(tmp_path, "new", 2)
    os.rename(old, tmp_path / f".ck.{DEAD}.old")
    os.remove(os.path.join(new, "COMMITTED"))
    os.rename(new, old)
    engine = _engine()
    engine.load_checkpoint(old)
    assert engine.steps_done == 1 and os.listdir(tmp_path) == ["ck"]
