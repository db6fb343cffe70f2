"""LlamaFactory's media_dir: records' image paths are relative to it, and by default, for datasets
named in dataset_info.json, to dataset_dir (LlamaFactory's default media_dir), not to the data
file's own folder; a path that is not there names where it was looked for."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.data import grid_images, tokens
from tests.train import files, vlm_files


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("media")
    model = vlm_files.model_dir(str(tmp / "model"))
    os.makedirs(tmp / "data" / "sub")
    vlm_files.records(str(tmp / "data" / "records.jsonl"), n=4)       # the file moves down; its image paths stay relative to data/
    shutil.move(str(tmp / "data" / "records.jsonl"), str(tmp / "data" / "sub" / "records.jsonl"))
    (tmp / "data" / "dataset_info.json").write_text(json.dumps({"shown": {"file_name": "sub/records.jsonl"}}))
    return tmp, model


def _tokens(c, model, folder):
    media = grid_images.media(model)
    tokenizer = tokens.load_tokenizer(model)
    tokenizer.chat_template = tokenizer.chat_template or media.chat_template()
    return tokens.token_file(folder, "train", c.data, tokenizer, model, False, media)


def test_image_paths_are_relative_to_media_dir(work, tmp_path):
    tmp, model = work
    common = dict(model=model, data=str(tmp / "data" / "sub" / "records.jsonl"), steps=1)
    with pytest.raises(ArgumentError, match=r"records.jsonl:1: image images/\w+.png is not there .*; image paths "
                                            r"are relative to the data file's folder \(or to media_dir"):
        _tokens(load(files.run_yaml(str(tmp_path / "a.yaml"), **common), []), model, str(tmp_path / "a"))
    c = load(files.run_yaml(str(tmp_path / "b.yaml"), media_dir=str(tmp / "data"), **common), [])
    made = _tokens(c, model, str(tmp_path / "b"))
    shown = [path for _, paths in made.images.values() for path in paths]
    assert [os.path.dirname(path) for path in shown] == [str(tmp / "data" / "images")] * 3
    with pytest.raises(ArgumentError, match="media_dir .*nowhere is not a folder"):
        load(files.run_yaml(str(tmp_path / "c.yaml"), media_dir=str(tmp / "nowhere"), **common), [])


def test_a_llamafactory_datasets_media_is_relative_to_dataset_dir(work, tmp_path):
    tmp, model = work
    c = load(files.run_yaml(str(tmp_path / "lf.yaml"), model=model, dataset="shown", dataset_dir=str(tmp / "data"),
                            steps=1), [])
    made = _tokens(c, model, str(tmp_path / "lf"))
    assert len(made.images) == 3
