"""streaming: true cuts the same rows as a token file read in order (shuffling off), pass after
pass (records truncated to the row and packed whole alike); a row asked for out of order (a resume's first) is the row read in order; and a bad record
met by the tokenising thread stops the run with its error."""
from __future__ import annotations

import numpy as np
import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import entries, mixture, packing, tokens
from megacompile.train.data.streaming import StreamRows
from tests.train import files, records as data


def _entries(tmp_path, weights):
    paths = [data.jsonl(tmp_path / "chats.jsonl", data.sharegpt(13)),
             data.parquet(tmp_path / "alpaca.parquet", data.alpaca(9)),
             data.json_array(tmp_path / "notes.json", data.texts(7))]
    items = entries.check("data", [{"path": p, "weight": w} for p, w in zip(paths, weights)] if weights else paths,
                          False, True)
    strategy, normal = entries.mixture(items, "interleave_over" if weights else None, None)
    return items, strategy, normal


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("weights", [None, [0.5, 0.3, 0.2]])
@pytest.mark.parametrize("pack", [True, False, "isolated"])
def test_streamed_rows_are_the_token_files_rows_in_file_order(tmp_path, weights, pack):
    tok = files.tokenizer()
    items, strategy, normal = _entries(tmp_path, weights)
    made = tokens.token_file(str(tmp_path / "tokens"), "train", items, tok, None, False, cutoff=16)
    mix = None
    if normal is not None:
        docs = np.arange(made.n_docs)
        labels = mixture.source_of(made, docs)
        by_source = [docs[labels == i] for i in range(3)]
        mix = lambda epoch: mixture.epoch_order(by_source, normal, strategy, 0, epoch, shuffle=False)  # noqa: E731
    rows = packing.Rows(made, 16, pack, 0, shuffle=False, pad_id=0, mix=mix)
    stream = StreamRows(items, normal, strategy, tok, False, 16, pack)
    try:
        n = 2 * rows.rows_per_epoch + 3          # past two pass boundaries
        assert all(_same(stream.row(r), rows.row(r)) for r in range(n))
        # out of order: a resume asks for its row first; earlier rows start the stream again
        fresh = StreamRows(items, normal, strategy, tok, False, 16, pack)
        assert _same(fresh.row(n - 2), rows.row(n - 2)) and _same(fresh.row(1), rows.row(1))
        fresh.close()
    finally:
        stream.close()


def test_a_bad_record_met_while_streaming_is_raised_in_the_training_loop(tmp_path):
    path = data.jsonl(tmp_path / "odd.jsonl", data.texts(40) + [{"question": "?"}])
    stream = StreamRows(entries.check("data", path, False, False), None, "concat", files.tokenizer(), False, 8, True)
    with pytest.raises(ArgumentError, match=r"odd.jsonl:41: a record is in none of the layouts read"):
        for r in range(1000):
            stream.row(r)
    stream.close()


def test_streamed_data_the_loss_counts_nothing_of_is_refused_not_looped_over(tmp_path):
    path = data.jsonl(tmp_path / "prompts.jsonl", [{"prompt": "the cat sat", "completion": ""}] * 3)
    stream = StreamRows(entries.check("data", path, False, False), None, "concat", files.tokenizer(), False, 8, True)
    with pytest.raises(ArgumentError, match="has no token the loss counts"):
        for r in range(1000):
            stream.row(r)
    stream.close()


def test_a_streamed_run_trains_and_evaluates_on_an_eval_file(tmp_path):
    from megacompile.train import load, log, run
    train = data.parquet(tmp_path / "notes.parquet", data.texts(30))
    held = data.jsonl(tmp_path / "held.jsonl", data.texts(4, start=3))
    tiny = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
            "bundled_model.ffn=64", "device=cpu", "batch=2", "seq=16", "steps=3", "eval_every=3", "streaming=true",
            f"data={train}", f"eval={held}", f"run_dir={tmp_path / 'run'}"]
    result = run(load(None, tiny))
    assert result["steps"] == 3
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert rows[-1]["eval_loss"] and not (tmp_path / "run" / "tokens" / "train.ids").exists()
    assert (tmp_path / "run" / "tokens" / "eval.ids").exists()


def test_a_run_stopped_by_a_bad_record_resumes_once_it_is_fixed_exactly(tmp_path, monkeypatch):
    """The stream meets a bad record in its second window; fixed, the run resumes from its last
    checkpoint (the rows before it read again and found the same) and trains as a run on the fixed
    file from the start does. A change before the checkpoint's rows is refused."""
    from megacompile.train import load, log, run
    from megacompile.train.data import placement
    monkeypatch.setattr(placement, "WINDOW", 6)      # documents placed together: windows of 6
    texts = data.texts(30)
    path = tmp_path / "notes.jsonl"
    data.jsonl(path, texts[:9] + [{"question": "?"}] + texts[10:])
    tiny = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
            "bundled_model.ffn=64", "device=cpu", "batch=2", "seq=16", "steps=12", "streaming=true",
            "save_every=1", "resume=auto", "lr=1e-3", f"data={path}"]
    with pytest.raises(ArgumentError, match=r"notes.jsonl:10: a record is in none of the layouts read"):
        run(load(None, tiny + [f"run_dir={tmp_path / 'run'}"]))
    stopped = len(log.read(str(tmp_path / "run" / "log.csv")))
    assert 0 < stopped < 12
    data.jsonl(path, texts)                                           # fixed
    assert run(load(None, tiny + [f"run_dir={tmp_path / 'run'}"]))["steps"] == 12
    run(load(None, tiny + [f"run_dir={tmp_path / 'whole'}"]))
    losses = [[float(r["loss"]) for r in log.read(str(tmp_path / name / "log.csv"))] for name in ("run", "whole")]
    assert len(losses[0]) == 12 and losses[0] == losses[1]
    # an early record changed: the rows a checkpoint was trained on are not those read again
    data.jsonl(path, [{"text": "a new first document"}] + texts[1:])
    with pytest.raises(ArgumentError, match="was saved by a run on other data: .*notes.jsonl changed size"):
        run(load(None, tiny + [f"run_dir={tmp_path / 'run'}", "steps=14"]))
