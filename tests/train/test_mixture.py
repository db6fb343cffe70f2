"""Weighted mixtures of data entries: each source's share of the rows follows its weight, the
order is a pure function of the seed, and a run killed with SIGKILL resumes to the rows (and log)
of the run that was never interrupted."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.stages.sft import _data
from megacompile.train.data.mixture import interleave, source_of
from tests.train import files, records as data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WEIGHTS = [0.5, 0.3, 0.2]


def _sources(tmp_path, n: tuple[int, int, int]) -> list[dict]:
    paths = [data.jsonl(tmp_path / "chats.jsonl", data.sharegpt(n[0])),
             data.json_array(tmp_path / "alpaca.json", data.alpaca(n[1])),
             data.parquet(tmp_path / "notes.parquet", data.texts(n[2]))]
    return [{"path": p, "weight": w} for p, w in zip(paths, WEIGHTS)]


def _passes(*sizes):
    return [lambda k, i=i, n=n: iter([(i, k, j) for j in range(n)]) for i, n in enumerate(sizes)]


def test_interleave_follows_the_weights_and_its_strategy_decides_where_an_epoch_ends():
    under = list(interleave(WEIGHTS, "interleave_under", _passes(10, 10, 10)))
    taken = [sum(1 for s, _ in under if s == i) for i in range(3)]
    assert taken == [10, 6, 4]            # the first source ran out: the epoch ends there
    for n in range(1, len(under) + 1):    # every prefix holds each share to within one document
        assert all(abs(sum(1 for s, _ in under[:n] if s == i) - w * n) < 1 for i, w in enumerate(WEIGHTS))
    over = list(interleave(WEIGHTS, "interleave_over", _passes(10, 10, 10)))
    seen = {(i, j) for _, (i, k, j) in over if k == 0}
    assert len(seen) == 30                # every source read to its end once
    assert over[-1] == (2, (2, 0, 9))     # it ends with the last source's last document
    counts = [sum(1 for s, _ in over if s == i) for i in range(3)]
    assert counts[2] == 10 and all(abs(n - w * len(over)) < 1 for n, w in zip(counts, WEIGHTS))
    assert {k for _, (i, k, _) in over if i == 0} == {0, 1, 2}
    concat = [item for _, item in interleave(None, "concat", _passes(2, 1, 3))]
    assert concat == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (2, 0, 0), (2, 0, 1), (2, 0, 2)]
    assert list(interleave([1.0, 0.0], "interleave_over", _passes(2, 5))) == [(0, (0, 0, 0)), (0, (0, 0, 1))]


def test_each_source_has_its_weight_of_the_first_thousand_rows(tmp_path):
    """packing: false, so a row holds one document and counting rows counts documents."""
    work = {"model": files.model_dir(str(tmp_path / "model"))}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=_sources(tmp_path, (700, 900, 600)),
                            seq=48, packing=False, steps=1, run_dir="run"))
    _, made, rows, _, _ = _data(c, str(tmp_path / "run"), c.seq)
    counts = np.zeros(3)
    for r in range(1000):
        docs = rows.documents(r)
        assert len(docs) == 1                 # no document needs a second row
        counts[source_of(rows.tokens, np.asarray(docs))[0]] += 1
    share = counts / 1000
    assert np.all(np.abs(share - WEIGHTS) < 0.03), share     # all documents once would be 32%, 41%, 27%
    # interleave_under: the epoch ended when the first source (700 / 0.5 = 1400 turns) ran out
    assert rows.rows_per_epoch == 1400
    # the order is the seed's: another seed, other documents in the same shares
    again = _data(c, str(tmp_path / "run"), c.seq)[2]
    assert [again.documents(r) for r in range(50)] == [rows.documents(r) for r in range(50)]
    c.seed = 1
    other = _data(c, str(tmp_path / "run"), c.seq)[2]
    assert [other.documents(r) for r in range(50)] != [rows.documents(r) for r in range(50)]


def _settings(tmp_path, name: str, **more) -> dict:
    # a few rows an epoch: the 12 rows trained cross epochs (each a new draw of the mixture)
    return dict(model=str(tmp_path / "model"), data=_sources(tmp_path, (8, 5, 5)), seq=32, packing=True, batch=2,
                grad_accum=1, steps=6, lr=3e-3, warmup=1, save_every=2, keep_last=2, device="cpu", resume="auto",
                run_dir=name, log_every=1, **more)


SAME = ("step", "loss", "lr", "grad_norm", "tokens")


@pytest.mark.parametrize("streaming", [pytest.param(False, marks=pytest.mark.slow),
                                       pytest.param(True, marks=pytest.mark.long)])   # 20-30 s each
def test_a_mixture_killed_mid_way_resumes_to_the_rows_of_the_uninterrupted_run(tmp_path, streaming):
    files.model_dir(str(tmp_path / "model"))
    whole = run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings(tmp_path, "whole",
                                                                               streaming=streaming))))
    assert whole["steps"] == 6
    config = files.run_yaml(str(tmp_path / "cut.yaml"), **_settings(tmp_path, "cut", streaming=streaming))
    child = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "train", "crash_child.py"), config, "5"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    resumed = run(load(config))              # from step 4; step 5's row is written again
    assert resumed["steps"] == 6
    a, b = log.read(str(tmp_path / "whole" / "log.csv")), log.read(str(tmp_path / "cut" / "log.csv"))
    assert [{k: r[k] for k in SAME} for r in a] == [{k: r[k] for k in SAME} for r in b]
    assert len(a) == 6 and len({r["loss"] for r in a}) == 6
    if not streaming:       # the run crossed epochs, and each drew its own order
        c = load(config)
        rows = _data(c, str(tmp_path / "cut"), c.seq)[2]
        assert rows.rows_per_epoch < 12 and rows.documents(0) != rows.documents(rows.rows_per_epoch)
    # other weights would count other rows from the same position: refused
    other = _settings(tmp_path, "cut", streaming=streaming)
    other["data"] = [{**e, "weight": w} for e, w in zip(other["data"], [0.2, 0.3, 0.5])]
    with pytest.raises(ArgumentError, match="cut its rows otherwise"):
        run(load(files.run_yaml(str(tmp_path / "other.yaml"), **other), ["steps=8"]))
    other["data"] = [e["path"] for e in other["data"]]      # no weights: every document once an epoch
    with pytest.raises(ArgumentError, match="cut its rows otherwise|on other data"):
        run(load(files.run_yaml(str(tmp_path / "other.yaml"), **other), ["steps=8"]))


def test_a_mixture_with_eval_fraction_mixes_the_documents_left_to_train(tmp_path):
    files.model_dir(str(tmp_path / "model"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=str(tmp_path / "model"), packing=False,
                            data=_sources(tmp_path, (60, 40, 30)), seq=48, steps=1, run_dir="run", eval_fraction=0.25))
    _, made, rows, held, _ = _data(c, str(tmp_path / "run"), c.seq)
    trained = {d for r in range(rows.rows_per_epoch) for d in rows.documents(r)}
    evaluated = {d for r in range(held.rows_per_epoch) for d in held.documents(r)}
    assert trained and evaluated and not trained & evaluated        # held-out documents never train
    labels = source_of(rows.tokens, np.asarray(sorted(trained)))
    assert set(labels.tolist()) == {0, 1, 2}
