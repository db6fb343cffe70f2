"""eval_fraction holds out that fraction of the tokens, whatever the documents' sizes (a .txt file
is one document), and the run says how many tokens and documents went each way."""
from __future__ import annotations

import numpy as np

from megacompile.train import load, run
from megacompile.train.data import split, tokens

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "steps=1"]


def _tokens(tmp_path, *texts):
    paths = []
    for i, text in enumerate(texts):
        (tmp_path / f"d{i}.txt").write_text(text)
        paths.append(str(tmp_path / f"d{i}.txt"))
    return tokens.token_file(str(tmp_path / "tokens"), "train", paths, tokens.ByteTokenizer(), None, False)


def _spans(cut: split.Split, docs) -> list[int]:
    return [i for d in docs for i in range(int(cut.tokens.docs[d]), int(cut.tokens.docs[d + 1]))]


def test_a_fraction_of_the_tokens_is_held_out_even_from_one_document(tmp_path):
    made = _tokens(tmp_path, "the cat sat on the mat " * 50)          # one document, 1,150 tokens
    cut = split.hold_out(made, 0.05, seed=0)
    assert cut.tokens_in(cut.held) == round(0.05 * 1150) and cut.tokens_in(cut.train) == 1150 - 58
    assert cut.cut and sorted(_spans(cut, cut.held) + _spans(cut, cut.train)) == list(range(1150))


def test_whole_documents_are_held_out_until_the_fraction_and_one_is_cut_there(tmp_path):
    made = _tokens(tmp_path, "a" * 900, "b" * 50, "c" * 50)
    for seed in range(4):
        cut = split.hold_out(made, 0.1, seed)
        assert cut.tokens_in(cut.held) == 100
        assert sorted(_spans(cut, cut.held) + _spans(cut, cut.train)) == list(range(1000))
        assert not set(np.asarray(cut.held).tolist()) & set(np.asarray(cut.train).tolist())


def test_the_run_says_what_went_to_eval_and_to_training(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("the cat sat on the mat " * 200)    # 4,600 bytes, one document
    run(load(None, [*TINY, f"data={tmp_path / 'notes.txt'}", "eval_fraction=0.05", "eval_every=1",
                    f"run_dir={tmp_path / 'run'}"]))
    out = capsys.readouterr().out
    assert "4,370 tokens (1 document) to train; 230 tokens (1 document) held out to evaluate" in out
