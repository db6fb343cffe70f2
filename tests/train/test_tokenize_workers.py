"""tokenize_workers (LlamaFactory's preprocessing_num_workers, TRL's dataset_num_proc): the token
file made by several processes is the one one process makes, byte for byte, a bad record is named
by its line as one process names it, and the keys read as LlamaFactory's and TRL's."""
from __future__ import annotations

import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.data import entries, tokens, workers
from tests.train import files, records as data


def _files(folder) -> dict:
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


def test_several_processes_make_the_token_file_one_makes(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "CHUNK", 5)       # many tasks, several in flight per worker
    paths = [data.jsonl(tmp_path / "chats.jsonl", data.sharegpt(41)),
             data.parquet(tmp_path / "alpaca.parquet", data.alpaca(23)),
             data.json_array(tmp_path / "notes.json", data.texts(17))]
    items = entries.check("data", paths, False, False)
    made = {}
    for n in (1, 3):
        folder = str(tmp_path / f"tokens{n}")
        tokens.commit(tokens.token_file(folder, "train", items, files.tokenizer(), None, False, cutoff=24,
                                        workers=n), folder)
        made[n] = _files(folder)
    assert made[1] == made[3] and len(made[1]["train.ids"]) > 0


def test_a_bad_record_is_named_by_its_line_as_one_process_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "CHUNK", 4)
    path = data.jsonl(tmp_path / "odd.jsonl", data.texts(30) + [{"question": "?"}] + data.texts(9))
    items = entries.check("data", [path], False, False)
    with pytest.raises(ArgumentError, match=r"odd.jsonl:31: a record is in none of the layouts read"):
        tokens.token_file(str(tmp_path / "tokens"), "train", items, files.tokenizer(), None, False, workers=2)


def test_llamafactorys_and_trls_keys_set_the_workers(tmp_path):
    common = dict(model=files.model_dir(str(tmp_path / "model")), data=files.chats(str(tmp_path / "c.jsonl")),
                  steps=1)
    cores = os.cpu_count() or 1
    assert load(files.run_yaml(str(tmp_path / "a.yaml"), **common), []).tokenize_workers == 1
    assert load(files.run_yaml(str(tmp_path / "b.yaml"), preprocessing_num_workers=None, **common),
                []).tokenize_workers == 1
    assert load(files.run_yaml(str(tmp_path / "c.yaml"), preprocessing_num_workers=2, **common),
                []).tokenize_workers == min(2, cores)
    assert load(files.run_yaml(str(tmp_path / "d.yaml"), dataset_num_proc=64, **common),
                []).tokenize_workers == min(64, cores)       # more processes than cores buy nothing
    with pytest.raises(ArgumentError, match="tokenize_workers must be a whole number >= 1; got 0"):
        load(files.run_yaml(str(tmp_path / "e.yaml"), tokenize_workers=0, **common), [])


def test_the_records_are_tokenised_in_the_workers_not_in_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "CHUNK", 3)
    seen = tmp_path / "pids"
    made = workers.made

    def noted(where, record, work):         # the fork carries this stand-in into the workers
        with open(seen, "a") as f:
            f.write(f"{os.getpid()}\n")
        return made(where, record, work)
    monkeypatch.setattr(workers, "made", noted)
    items = entries.check("data", [data.jsonl(tmp_path / "notes.jsonl", data.texts(24))], False, False)
    tokens.token_file(str(tmp_path / "tokens"), "train", items, files.tokenizer(), None, False, workers=2)
    pids = set(seen.read_text().split())
    assert len(seen.read_text().split()) == 24 and pids and str(os.getpid()) not in pids


def test_a_worker_that_dies_is_named_and_the_others_are_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "CHUNK", 3)
    made = workers.made

    def dies(where, record, work):          # the fork carries this stand-in into the workers
        if where.endswith(":7"):
            os._exit(3)
        return made(where, record, work)
    monkeypatch.setattr(workers, "made", dies)
    items = entries.check("data", [data.jsonl(tmp_path / "notes.jsonl", data.texts(24))], False, False)
    with pytest.raises(RuntimeError, match=r"a tokenize worker \(pid \d+\) ended without its result \(exit code 3\); "
                                           "run again with tokenize_workers: 1"):
        tokens.token_file(str(tmp_path / "tokens"), "train", items, files.tokenizer(), None, False, workers=2)
    import multiprocessing
    assert not [p for p in multiprocessing.active_children() if p.name == "megacompile-tokenise"]
