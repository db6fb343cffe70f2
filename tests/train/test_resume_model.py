"""A resume on a model configured otherwise than the one its checkpoint trained is refused, even
where every weight keeps its shape (train/resume_model.py): the heads a projection splits into,
rope_theta. The same model resumes as before."""
from __future__ import annotations

import json
import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files

TEXT = "the cat sat on the mat. " * 8
BUNDLED = dict(model="bundled", bundled_model=dict(dim=32, layers=1, heads=2, kv_heads=1, ffn=64))


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.txt").write_text(TEXT)
    return files.run_yaml(str(tmp_path / "run.yaml"), **{"device": "cpu", "seq": 16, "data": ["d.txt"],
                                                         "run_dir": "run", "save_every": 1, **settings})


def _folder(tmp_path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "run") for f in fs)


def test_other_heads_of_the_same_shapes_are_refused_and_the_same_model_resumes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(load(_yaml(tmp_path, steps=2, **BUNDLED), []))
    before = _folder(tmp_path)
    with pytest.raises(ArgumentError, match=r"step-000002 was saved by a run of a model configured otherwise "
                                            r"\(heads 2 -> 4, kv_heads 1 -> 2\): its weights would compute something "
                                            r"else here; resume it with the model it trained"):
        run(load(_yaml(tmp_path, steps=3, resume="auto", **BUNDLED), ["bundled_model.heads=4",
                                                                      "bundled_model.kv_heads=2"]))
    assert _folder(tmp_path) == before
    assert run(load(_yaml(tmp_path, steps=3, resume="auto", **BUNDLED), []))["steps"] == 3
    assert [int(r["step"]) for r in log.read(str(tmp_path / "run" / "log.csv"))] == [1, 2, 3]


def test_a_model_folder_whose_config_changed_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = files.model_dir(str(tmp_path / "model"))
    run(load(_yaml(tmp_path, steps=2, model="model", data=[files.chats(str(tmp_path / "chats.jsonl"))]), []))
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    theta = config["rope_theta"] if "rope_theta" in config else config["rope_parameters"]["rope_theta"]
    if "rope_theta" in config:
        config["rope_theta"] = theta * 2
    else:
        config["rope_parameters"]["rope_theta"] = theta * 2
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ArgumentError, match=rf"configured otherwise \(.*rope_theta {theta!r} -> {theta * 2!r}"):
        run(load(_yaml(tmp_path, steps=3, resume="auto", model="model", data=["chats.jsonl"]), []))


def test_an_entry_one_config_lacks_is_a_transformers_release_not_a_change():
    """A transformers release that adds a config field writes it into the resumed model's config,
    not into the checkpoint's: only the values both hold are compared."""
    from megacompile.train.resume_model import changes
    before = {"heads": 4, "text_config": {"rope_theta": 1e4}}
    assert changes(before, {"heads": 4, "new_field": 1, "text_config": {"rope_theta": 1e4, "added": 0}}) == []
    assert changes(before, {"heads": 8, "text_config": {"rope_theta": 2e4}}) == [
        "heads 4 -> 8", "text_config.rope_theta 10000.0 -> 20000.0"]
