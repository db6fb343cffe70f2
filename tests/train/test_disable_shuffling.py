"""disable_shuffling (LlamaFactory's key): the run reads its documents in the files' order and its rows
in stream order, every epoch, as LlamaFactory's sequential sampler does; the post-training stages read
their pairs and prompts in order; a resume that changes it is refused, its rows being other rows."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from megacompile.train.stages import open_stage
from megacompile.train.stages.order import stream_items
from tests.train import files

TINY = ["device=cpu", "batch=1", "seq=48", "resume=auto", "packing=false"]


def _given(tmp_path) -> list[str]:
    model = tmp_path / "llama"
    if not model.exists():
        files.model_dir(str(model), dim=32, layers=1)
    return [*TINY, f"model={model}", f"data={files.chats(str(tmp_path / 'chats.jsonl'))}"]


def _first_ids(tmp_path, name: str, shuffle_off: bool, rows: int) -> tuple[list[list[int]], int, object]:
    """The first `rows` rows' tokens, the rows an epoch, and the stage."""
    c = load(None, [*_given(tmp_path), f"run_dir={tmp_path / name}", f"disable_shuffling={str(shuffle_off).lower()}"])
    stage = open_stage(c, str(tmp_path / name))
    try:
        return [stage.rows.row(i)[0].tolist() for i in range(rows)], stage.rows.rows_per_epoch, stage
    finally:
        stage.discard()


def test_records_come_in_the_files_order_every_epoch(tmp_path):
    ordered, n, stage = _first_ids(tmp_path, "ordered", True, 24)
    # each record fills a row of its own (packing false): row i is record i, in both epochs
    docs = stage.rows.tokens.docs
    ids = stage.rows.tokens.ids
    records = [ids[docs[d]:docs[d + 1]].tolist() for d in range(stage.rows.tokens.n_docs)]
    assert n == len(records) == 12
    assert [row[:len(records[i % n])] for i, row in enumerate(ordered)] == [records[i % n] for i in range(24)]
    shuffled, _, _ = _first_ids(tmp_path, "shuffled", False, 24)
    assert shuffled[:n] != ordered[:n] and shuffled[n:] != shuffled[:n]     # the default shuffles, anew each epoch


def test_pairs_and_prompts_come_in_order():
    assert stream_items(5, 3, 3, 4, shuffle=False) == [3, 4, 0, 1]
    assert stream_items(5, 3, 0, 5) != list(range(5)) and sorted(stream_items(5, 3, 0, 5)) == list(range(5))


def test_a_resume_that_changes_it_is_refused(tmp_path):
    common = [*_given(tmp_path), f"run_dir={tmp_path / 'run'}", "steps=1"]
    run(load(None, common))
    with pytest.raises(ArgumentError, match=r"cut its rows otherwise \(shuffle True -> False\); resume it with the "
                                            r"same seq, packing, seed, eval_fraction, mixture and disable_shuffling"):
        run(load(None, [*common, "steps=2", "disable_shuffling=true"]))
