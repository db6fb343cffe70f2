"""A run's checkpoint (a token file's, a streamed run's, stages dpo and grpo too) keeps the sources
its data was made from, and a resume on other data is refused naming what changed: a data file
grown, moved (same size), a tokenizer file, train_on_prompt. A checkpoint that kept none gets the
refusal by hashes."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from tests.posttrain import stage_files
from tests.train import files


def _streamed(tmp_path, **more) -> str:
    """run.yaml of a tiny streamed fine-tuning run (one step, then resume: auto)."""
    model = str(tmp_path / "model")
    if not os.path.isdir(model):
        files.model_dir(model, layers=1, dim=32)
        files.chats(str(tmp_path / "chats.jsonl"))
    settings = dict(model=model, data=str(tmp_path / "chats.jsonl"), streaming=True, seq=24, batch=1, steps=1,
                    lr=1e-3, warmup=0, schedule="constant", device="cpu", resume="auto",
                    run_dir=str(tmp_path / "run"), log_every=1)
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**settings, **more})


def _manifest(tmp_path) -> str:
    folder = tmp_path / "run" / "checkpoints"
    return str(folder / sorted(n for n in os.listdir(folder) if n.startswith("step-"))[-1] / "manifest.json")


def test_a_token_file_resume_on_a_grown_data_file_names_the_file(tmp_path):
    assert run(load(_streamed(tmp_path, streaming=False), []))["steps"] == 1
    with open(_manifest(tmp_path)) as f:
        extra = json.load(f)["extra"]
    assert not extra["data"].startswith("stream-")      # the token file's own hash, its sources beside it
    assert extra["data_sources"]["files"][0]["files"][0]["path"] == str(tmp_path / "chats.jsonl")
    before = os.path.getsize(tmp_path / "chats.jsonl")
    with open(tmp_path / "chats.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "the dog"},
                                         {"role": "assistant", "content": "sat on the cat"}]}) + "\n")
    with pytest.raises(ArgumentError) as refused:
        run(load(_streamed(tmp_path, streaming=False, steps=2), []))
    message = str(refused.value)
    print(message)
    assert message.startswith(f"{os.path.dirname(_manifest(tmp_path))} was saved by a run on other data: ")
    assert str(tmp_path / "chats.jsonl") in message and f"{before}" in message
    assert "token file" not in message


def test_a_dpo_resume_on_its_pairs_copied_elsewhere_names_the_file_as_moved(tmp_path):
    work = stage_files.workspace(tmp_path)
    settings = stage_files.dpo(work, str(tmp_path / "run"), steps=1,
                               resume="auto")
    assert run(load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), []))["steps"] == 1
    os.makedirs(tmp_path / "copy")
    moved = shutil.copy(work["pairs"], tmp_path / "copy" / "pairs.jsonl")
    os.utime(moved, ns=(1, 1))
    again = files.run_yaml(str(tmp_path / "again.yaml"), **{**settings, "data": str(moved), "steps": 2})
    with pytest.raises(ArgumentError) as refused:
        run(load(again, []))
    message = str(refused.value)
    print(message)
    size = os.path.getsize(work["pairs"])
    assert "was saved by a run on other data: " in message
    assert (f"pairs.jsonl moved from {tmp_path} to {tmp_path / 'copy'} (same size, {size} bytes: if its content "
            f"is the same, move it back to {tmp_path})") in message
    assert message.endswith("resume it with the same data, tokenizer and settings, or start a new run_dir")
    assert "stream-" not in message and "is gone" not in message and "is new" not in message


def test_a_streamed_resume_under_a_changed_tokenizer_file_names_it(tmp_path, capsys):
    assert run(load(_streamed(tmp_path), []))["steps"] == 1
    # a change that writes other tokens: refused, named
    template = tmp_path / "model" / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|end|>", "<|end|> <|end|>"))
    with pytest.raises(ArgumentError) as refused:
        run(load(_streamed(tmp_path, steps=2), []))
    message = str(refused.value)
    print(message)
    assert "was saved by a run on other data: chat_template.jinja changed; resume it with the same" in message
    # one that writes the same tokens: the rows read before the checkpoint are read again, the same
    template.write_text(template.read_text().replace("<|end|> <|end|>", "<|end|>"))
    config = tmp_path / "model" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 4096}))
    capsys.readouterr()
    assert run(load(_streamed(tmp_path, steps=2), []))["steps"] == 2
    assert ("resume note    the data changed (tokenizer_config.json changed); the rows before the checkpoint's "
            "position (row 1), read again, are the same: going on") in capsys.readouterr().out


def test_a_streamed_resume_with_train_on_prompt_flipped_names_it(tmp_path):
    assert run(load(_streamed(tmp_path), []))["steps"] == 1
    with pytest.raises(ArgumentError) as refused:
        run(load(_streamed(tmp_path, steps=2, train_on_prompt=True), []))
    message = str(refused.value)
    print(message)
    assert "was saved by a run on other data: train_on_prompt False -> True; resume it with the same" in message


def test_a_checkpoint_that_kept_no_sources_is_refused_by_its_hashes(tmp_path):
    assert run(load(_streamed(tmp_path), []))["steps"] == 1
    path = _manifest(tmp_path)
    with open(path) as f:
        manifest = json.load(f)
    assert manifest["extra"]["data_sources"]["train_on_prompt"] is False    # kept beside the fingerprint
    del manifest["extra"]["data_sources"]       # as a checkpoint saved before the sources were kept
    with open(path, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ArgumentError) as refused:
        run(load(_streamed(tmp_path, steps=2, train_on_prompt=True), []))
    message = str(refused.value)
    print(message)
    assert f"was saved by a run on other tokens (token file {manifest['extra']['data']}, now stream-" in message
    assert "train_on_prompt changed" in message and "other data:" not in message
