"""A checkpoint keeps how its data tokenizes (train/tokenized.py): a resume whose same data files
now make other tokens (a newer megacompile that writes a layout otherwise, another tokenizers
release) is refused, naming the first item that differs and what tokenized it before; an unchanged
resume goes on; a checkpoint saved before the record was kept goes on with a warning."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from megacompile.errors import ArgumentError
from megacompile.io import checkpoint, durable
from megacompile.train import load, run, tokenized
from megacompile.train.data import streaming
from megacompile.train.stages import dpo as dpo_stage
from megacompile.train.stages import rm as rm_stage
from tests.posttrain import stage_files
from tests.train import files


def _settings(tmp_path, stage: str, **more) -> str:
    """run.yaml of a tiny run of `stage` over stage_files' pairs (written by the first call alone)."""
    work = ({"model": str(tmp_path / "model"), "pairs": str(tmp_path / "pairs.jsonl")} if (tmp_path / "model").exists()
            else stage_files.workspace(tmp_path))
    settings = stage_files.dpo(work, str(tmp_path / "run"), **{"stage": stage, "steps": 1, "resume": "auto", **more})
    return files.run_yaml(str(tmp_path / "run.yaml"), **settings)


def _manifest(tmp_path) -> str:
    folder = tmp_path / "run" / "checkpoints"
    return str(folder / sorted(n for n in os.listdir(folder) if n.startswith("step-"))[-1] / "manifest.json")


def _chats_written_otherwise(module, monkeypatch) -> None:
    """The pairs whose prompt is a chat (pairs.jsonl's even lines) written without their first
    token, as a newer release that changed its chat layout would write them."""
    made = module.to_pair

    def to_pair(record, *args, **kwargs):
        pair = made(record, *args, **kwargs)
        return dataclasses.replace(pair, prompt=pair.prompt[1:]) if isinstance(record["prompt"], list) else pair
    monkeypatch.setattr(module, "to_pair", to_pair)


@pytest.mark.parametrize("stage, module, before", [("dpo", dpo_stage, "0.0.9"), ("rm", rm_stage, None)])
def test_a_resume_whose_pairs_tokenize_otherwise_is_refused_naming_the_first(tmp_path, monkeypatch, stage, module,
                                                                             before):
    saved_versions = tokenized.versions()
    if before is not None:      # the checkpoint written by an older megacompile
        monkeypatch.setattr(tokenized, "versions", lambda: {**saved_versions, "megacompile": before})
    assert run(load(_settings(tmp_path, stage), []))["steps"] == 1
    monkeypatch.setattr(tokenized, "versions", lambda: saved_versions)
    _chats_written_otherwise(module, monkeypatch)
    checkpoint = os.path.dirname(_manifest(tmp_path))
    with pytest.raises(ArgumentError) as refused:
        run(load(_settings(tmp_path, stage, steps=2), []))
    message = str(refused.value)
    print(message)
    assert message.startswith(f"{checkpoint} was saved by a run whose data tokenized otherwise: the same data files "
                              "now make other tokens (train: pair ")
    first = re.search(r"train: pair (\d+) of (\d+) \((.*?)\) tokenizes otherwise", message)
    # the first chat pair trained on (line 2's is held out by eval_fraction, and named too)
    assert first is not None and first[3] == f"{tmp_path / 'pairs.jsonl'}:4"
    assert f"; eval: pair 1 of 2 ({tmp_path / 'pairs.jsonl'}:2) tokenizes otherwise)" in message
    assert "its remaining steps would train on other token sequences than its first 1" in message
    if before is not None:
        assert f"; they were tokenized under megacompile {before} (now {saved_versions['megacompile']});" in message
        assert message.endswith(f"resume it under megacompile {before}, or start a new run_dir")
    else:
        assert f"; under the same megacompile {saved_versions['megacompile']}, transformers " in message
        assert ": the code of one of them changed (a development install), or a setting or file the data " \
               "check does not compare; its remaining" in message
        assert message.endswith("resume it with what tokenized its data, or start a new run_dir")
    assert not os.path.exists(os.path.join(os.path.dirname(checkpoint), "step-000002"))


def test_an_unchanged_resume_goes_on_and_an_older_checkpoint_with_a_warning(tmp_path, capsys):
    assert run(load(_settings(tmp_path, "dpo"), []))["steps"] == 1
    path = _manifest(tmp_path)
    with open(path) as f:
        manifest = json.load(f)
    kept = manifest["extra"][tokenized.KEY]
    assert kept["train"]["what"] == "pair" and kept["train"]["items"] + kept["eval"]["items"] == 10
    assert kept["versions"] == tokenized.versions()
    capsys.readouterr()
    assert run(load(_settings(tmp_path, "dpo", steps=2), []))["steps"] == 2
    assert "its data tokenizes" not in capsys.readouterr().out
    path = _manifest(tmp_path)
    with open(path) as f:
        manifest = json.load(f)
    del manifest["extra"][tokenized.KEY]       # as a checkpoint saved before the record was kept
    with open(path, "w") as f:
        json.dump(manifest, f)
    with open(os.path.join(os.path.dirname(path), checkpoint.MARKER), "w") as f:     # sealed again, as saved so
        f.write(durable.sha256_of(path) + "\n")
    assert run(load(_settings(tmp_path, "dpo", steps=3), []))["steps"] == 3
    out = capsys.readouterr().out
    assert (f"  warning        {os.path.dirname(path)} predates the record of how its data tokenizes: its tokens "
            "cannot be checked against this run's (the data files, tokenizer and settings were)\n") in out
    assert out.count("predates the record of how its data tokenizes") == 1


def test_a_streamed_resume_whose_records_tokenize_otherwise_is_refused(tmp_path, monkeypatch):
    """A streamed run's data fingerprint is its sources': the first records of each entry, tokenized
    for the record, show the tokens changed."""
    model, chats = str(tmp_path / "model"), files.chats(str(tmp_path / "chats.jsonl"))
    files.model_dir(model, layers=1, dim=32)

    def settings(**more) -> str:
        return files.run_yaml(str(tmp_path / "run.yaml"), **{
            "model": model, "data": chats, "streaming": True, "seq": 24, "batch": 1, "steps": 1, "lr": 1e-3,
            "warmup": 0, "schedule": "constant", "device": "cpu", "resume": "auto", "run_dir": str(tmp_path / "run"),
            **more})
    assert run(load(settings(), []))["steps"] == 1
    made = streaming.document

    def document(tokenizer, record, *args, **kwargs):       # two-exchange chats written otherwise
        doc = made(tokenizer, record, *args, **kwargs)
        return dataclasses.replace(doc, ids=doc.ids[1:], targets=doc.targets[1:]) \
            if len(record["messages"]) > 2 else doc
    monkeypatch.setattr(streaming, "document", document)
    with pytest.raises(ArgumentError) as refused:
        run(load(settings(steps=2), []))
    message = str(refused.value)
    print(message)
    assert f"now make other tokens (train: record 1 of 12 ({chats}:1) tokenizes otherwise); under the same" in message


def test_what_differs_past_the_first_items_and_in_count():
    def split(items: int, first: list[str]) -> dict:
        return {"what": "example", "items": items, "digest": f"{items}{first}", "first": first, "where": [None] * 3}
    versions = tokenized.versions()
    before = {"versions": versions, "train": split(40, ["a", "b", "c"]), "eval": split(3, ["d", "e", "f"])}
    assert tokenized.differences(before, {"versions": versions, "train": split(41, ["a", "b", "c"]),
                                          "eval": {**split(3, ["d", "e", "f"]), "digest": "other"}}) == [
        "train: 40 examples -> 41 examples",
        "eval: the first 3 of 3 examples tokenize as before, a later one otherwise"]
    assert tokenized.differences(before, {"versions": versions, "train": before["train"]}) == [
        "eval: 3 examples -> none"]
