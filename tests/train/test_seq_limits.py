"""A seq longer than the training data or than the model's positions is refused, naming both
numbers, before the engine exists and without leaving a run folder."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from megacompile.train.stages import open_stage
from tests.train import files

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "steps=1"]


def test_a_seq_longer_than_the_data_is_refused_before_anything_is_made(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").write_text("the cat sat on the mat " * 10)      # 230 byte tokens
    monkeypatch.setattr("megacompile.train.loop.build", lambda *a, **k: pytest.fail("the engine was built"))
    with pytest.raises(ArgumentError, match="seq 10,000,000 is longer than the training data, 230 tokens: .*"
                                            "give seq <= 230"):
        run(load(None, [*TINY, "seq=10000000", f"data={tmp_path / 'notes.txt'}", f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_a_seq_longer_than_the_models_positions_is_refused(tmp_path):
    model = files.model_dir(str(tmp_path / "model"))          # max_position_embeddings: 256
    notes = files.text(str(tmp_path / "notes.txt"))
    with pytest.raises(ArgumentError, match="seq 300 is longer than the model's max_position_embeddings, 256 "
                                            r"\(.*config.json\): give seq <= 256"):
        run(load(None, ["device=cpu", "steps=1", "seq=300", f"model={model}", f"data={notes}",
                        f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_a_refusal_after_the_checks_names_the_key_as_the_run_yaml_wrote_it(tmp_path):
    """LlamaFactory's cutoff_len is seq here: the refusal says cutoff_len, which the user wrote."""
    model = files.model_dir(str(tmp_path / "model"))          # max_position_embeddings: 256
    notes = files.text(str(tmp_path / "notes.txt"))
    with pytest.raises(ArgumentError, match=r"^cutoff_len \(megacompile's seq\): seq 300 is longer than the model's "
                                            "max_position_embeddings, 256"):
        run(load(None, ["device=cpu", "steps=1", "cutoff_len=300", f"model={model}", f"data={notes}",
                        f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_a_seq_longer_than_records_one_a_row_is_a_cap_as_cutoff_len_is(tmp_path):
    """LlamaFactory's cutoff_len caps a record: chats each in a row of their own train with a seq
    longer than all of them together."""
    model = files.model_dir(str(tmp_path / "model"))          # max_position_embeddings: 256
    chats = files.chats(str(tmp_path / "chats.jsonl"), n=2)
    path = files.run_yaml(str(tmp_path / "run.yaml"), model=model, data=[chats], seq=256, batch=1, steps=1,
                          device="cpu", run_dir=str(tmp_path / "run"))
    stage = open_stage(load(path, []), str(tmp_path / "run"), None)
    assert stage.rows.rows_per_epoch == 2
    stage.discard()
    with pytest.raises(ArgumentError, match="seq 256 is longer than the training data"):     # packed, they would not
        open_stage(load(path, ["packing=true"]), str(tmp_path / "packed"), None)
