"""train_from_scratch (LlamaFactory's key): the model folder's config.json, randomly initialised by the
run's seed, with the folder's tokenizer: the run `model: FOLDER/config.json` is, not the folder's weights."""
from __future__ import annotations

import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files


def _losses(tmp_path, name: str, **settings) -> list[float]:
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    c = load(files.run_yaml(str(tmp_path / f"{name}.yaml"), data=[chats], seq=32, batch=2, steps=2, lr=1e-3,
                            device="cpu", run_dir=str(tmp_path / name), log_every=1, save_every=False,
                            **settings), [])
    run(c)
    return [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]


def test_the_folders_config_trains_from_random_weights_with_its_tokenizer(tmp_path):
    # weights drawn from another seed than the run's: the folder's own are not what random init gives
    folder = files.model_dir(str(tmp_path / "llama"), seed=7, dim=32, layers=1)
    scratch = _losses(tmp_path, "scratch", model=folder, train_from_scratch=True)
    config = _losses(tmp_path, "config", model=os.path.join(folder, "config.json"), tokenizer=folder)
    pretrained = _losses(tmp_path, "pretrained", model=folder)
    assert scratch == config            # bit for bit: the same init from the same seed
    assert abs(scratch[0] - pretrained[0]) > 1e-3      # not the folder's weights


@pytest.mark.parametrize("model, says", [
    ("bundled", "train_from_scratch: the bundled model always starts from random weights"),
    ("config", "is a config file, which a run trains from scratch already"),
])
def test_where_it_asks_for_nothing_more_it_is_refused(tmp_path, model, says):
    folder = files.model_dir(str(tmp_path / "llama"), dim=32, layers=1)
    given = os.path.join(folder, "config.json") if model == "config" else model
    with pytest.raises(ArgumentError, match=says):
        load(files.run_yaml(str(tmp_path / "r.yaml"), model=given, tokenizer=folder if model == "config" else None,
                            data=[files.chats(str(tmp_path / "c.jsonl"))], train_from_scratch=True), [])
