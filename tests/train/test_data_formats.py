"""Data as people bring it: Alpaca records as chat messages with the loss on the answers, the
datasets library's kinds of file read as the same records as a .jsonl, and data entries that
are refused by name (layouts, weights, keys, hub ids)."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.data import tokens
from megacompile.train.data.entries import check
from megacompile.train.data.reading import records
from tests.train import files, records as data

Q, A = "hello there how are you", "i am fine thank you"


def _words(tok, ids, targets=None):
    words = tok.convert_ids_to_tokens(ids)
    return words if targets is None else [w for w, t in zip(words, targets) if t]


def test_alpaca_is_read_as_llamafactory_reads_it_and_trains_on_the_answers():
    tok = files.tokenizer()
    record = {"instruction": "what is the time", "input": "it is late", "output": Q, "system": "i am fine",
              "history": [["the cat sat", "a dog ran"]]}
    ids, targets = tokens.encode(tok, record, False, "x:1")
    chat = [{"role": "system", "content": "i am fine"}, {"role": "user", "content": "the cat sat"},
            {"role": "assistant", "content": "a dog ran"},
            {"role": "user", "content": "what is the time\nit is late"}, {"role": "assistant", "content": Q}]
    assert (ids, targets) == tokens.encode(tok, {"messages": chat}, False, "x:2")
    # the loss counts the assistant turns (the history's answer too, LlamaFactory's default) and nothing else
    assert _words(tok, ids, targets) == ["a", "dog", "ran", "<|end|>", *Q.split(), "<|end|>", "</s>"]
    _, every = tokens.encode(tok, record, True, "x:3")
    assert all(every)
    # no input: the instruction alone is the question
    plain = tokens.encode(tok, {"instruction": "what is the time", "output": A}, False, "x:4")
    assert plain == tokens.encode(tok, {"messages": [{"role": "user", "content": "what is the time"},
                                                     {"role": "assistant", "content": A}]}, False, "x:5")
    with pytest.raises(ArgumentError, match=r"x:6: an Alpaca record's history is a list of \[question, answer\]"):
        tokens.encode(tok, {**record, "history": ["the cat sat"]}, False, "x:6")


def test_a_record_in_no_layout_is_refused_naming_its_row_and_the_layouts(tmp_path):
    path = data.parquet(tmp_path / "odd.parquet", [{"question": "?", "answer": "!"}])
    with pytest.raises(ArgumentError) as e:
        tokens.token_file(str(tmp_path / "tokens"), "train", [path], files.tokenizer(), None, False)
    message = str(e.value)
    assert f"{path} row 0: a record is in none of the layouts read" in message
    assert "Alpaca's instruction, input, output" in message and "ShareGPT's conversations" in message
    assert "this one has answer, question" in message


@pytest.mark.parametrize("kind", ["parquet", "json", "arrow", "saved", "folder"])
def test_the_datasets_kinds_of_file_read_the_same_records_as_jsonl(tmp_path, kind):
    rows = data.alpaca(7) + [{"instruction": "it is late", "output": A}]     # keys some rows lack
    jsonl = data.jsonl(tmp_path / "a.jsonl", rows)
    if kind == "parquet":
        path = data.parquet(tmp_path / "a.parquet", rows)
    elif kind == "json":
        path = data.json_array(tmp_path / "a.json", rows)
    elif kind == "saved":
        path = data.saved(tmp_path / "saved", rows)
    elif kind == "arrow":
        folder = data.saved(tmp_path / "saved", rows)
        path = str(next((tmp_path / "saved").glob("*.arrow")))
        assert folder
    else:
        (tmp_path / "parts").mkdir()
        data.parquet(tmp_path / "parts" / "0.parquet", rows[:3])
        data.parquet(tmp_path / "parts" / "1.parquet", rows[3:])
        path = str(tmp_path / "parts")
    ours = [r for _, r in records(check("data", path, False, False)[0])]
    theirs = [r for _, r in records(check("data", jsonl, False, False)[0])]
    assert ours == theirs and len(ours) == 8
    tok = files.tokenizer()
    a = tokens.token_file(str(tmp_path / "t1"), "train", [path], tok, None, False)
    b = tokens.token_file(str(tmp_path / "t2"), "train", [jsonl], tok, None, False)
    assert a.fingerprint == b.fingerprint and list(a.docs) == list(b.docs)


def test_sharegpt_with_llamafactory_columns_and_tags_is_renamed(tmp_path):
    rows = [{"chat": [{"speaker": "me", "text": Q}, {"speaker": "bot", "text": A}], "sys": "it is late"}]
    path = data.jsonl(tmp_path / "c.jsonl", rows)
    entry = check("data", [{"path": path, "formatting": "sharegpt", "columns": {"messages": "chat", "system": "sys"},
                            "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me",
                                     "assistant_tag": "bot"}}], False, True)[0]
    (_, record), = records(entry)
    tok = files.tokenizer()
    assert tokens.encode(tok, record, False, "x") == tokens.encode(tok, data.sharegpt(1)[0] | {
        "conversations": [{"from": "human", "value": Q}, {"from": "gpt", "value": A}], "system": "it is late"},
        False, "y")


def _yaml(tmp_path, **settings) -> str:
    for name in ("a", "b"):
        data.jsonl(tmp_path / f"{name}.jsonl", data.texts(3))
    return files.run_yaml(str(tmp_path / "run.yaml"), **{"steps": 2, "run_dir": "run", **settings})


@pytest.mark.parametrize("settings, message", [
    ({"data": [{"path": "a.jsonl", "weight": -0.5}, {"path": "b.jsonl", "weight": 1}]},
     "the weight of {tmp}/a.jsonl must be a finite number >= 0; got -0.5"),
    ({"data": [{"path": "a.jsonl", "weight": 0}, {"path": "b.jsonl", "weight": 0.0}]}, "the weights are all zero"),
    ({"data": [{"path": "a.jsonl", "weight": 0.5}, "b.jsonl"]}, "{tmp}/b.jsonl has none; give every entry a weight"),
    ({"data": [{"path": "a.jsonl", "weight": 1, "wieght": 2}]}, "has unknown key wieght; an entry takes path, weight"),
    ({"data": [{"path": "a.jsonl", "weight": "heavy"}]}, "got 'heavy'"),
    ({"data": "org/name"}, "dataset ids of the Hugging Face hub are not read"),
    ({"data": "run.yaml"}, "is not a kind of file the data is read from"),
    ({"data": [{"path": "a.jsonl", "weight": 1}], "mix_strategy": "concat"}, "concat takes every document once"),
    ({"data": ["a.jsonl"], "mix_strategy": "zip"}, "mix_strategy must be one of concat, interleave_under"),
    ({"data": ["a.jsonl", "b.jsonl"], "interleave_probs": "0.5"}, "one weight per data entry (2)"),
    ({"data": ["a.jsonl"], "eval": [{"path": "b.jsonl", "weight": 1}]}, "eval data is not mixed"),
    ({"data": ["a.jsonl"], "streaming": True, "eval_fraction": 0.1}, "give eval files instead of eval_fraction"),
    ({"data": ["a.jsonl"], "streaming": True, "epochs": 1, "steps": None}, "epochs cannot be turned into steps"),
    ({"dataset": "missing", "dataset_dir": "."}, "dataset: missing is not in"),
])
def test_bad_data_entries_are_refused_by_name(tmp_path, settings, message):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.jsonl"}}))
    with pytest.raises(ArgumentError) as e:
        load(_yaml(tmp_path, **settings))
    assert message.format(tmp=tmp_path) in str(e.value)


def test_llamafactory_dataset_keys_read_dataset_info(tmp_path):
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "a": {"file_name": "a.jsonl"}, "b": {"file_name": "b.jsonl", "formatting": "sharegpt"}}))
    c = load(_yaml(tmp_path, dataset="a, b", dataset_dir=".", interleave_probs="0.75,0.25",
                   mix_strategy="interleave_over"))
    assert [e["path"] for e in c.data] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert [e["weight"] for e in c.data] == [0.75, 0.25] and c.mix_strategy == "interleave_over"
    assert [e["formatting"] for e in c.data] == ["alpaca", "sharegpt"]
    c = load(_yaml(tmp_path, dataset="a", eval_dataset="b", dataset_dir="."))
    assert [e["path"] for e in c.eval] == [str(tmp_path / "b.jsonl")] and c.eval[0]["formatting"] == "sharegpt"
    with pytest.raises(ArgumentError, match="eval_dataset: c is not in"):
        load(_yaml(tmp_path, dataset="a", eval_dataset="c", dataset_dir="."))


def test_a_csv_of_text_records_reads_as_its_jsonl(tmp_path):
    rows = data.texts(5)
    (tmp_path / "t.csv").write_text("text\n" + "".join(f'"{r["text"]}"\n' for r in rows))
    ours = [r for _, r in records(check("data", str(tmp_path / "t.csv"), False, False)[0])]
    assert ours == rows


def test_max_samples_reads_the_first_records_of_each_entry(tmp_path):
    c = load(_yaml(tmp_path, data=["a.jsonl", "b.jsonl"], max_samples=2))
    assert [len(list(records(e))) for e in c.data] == [2, 2]
    tok = files.tokenizer()
    assert tokens.token_file(str(tmp_path / "t"), "train", c.data, tok, None, False).n_docs == 4
    with pytest.raises(ArgumentError, match="max_samples must be a whole number >= 1; got 0"):
        load(_yaml(tmp_path, max_samples=0))


@pytest.mark.parametrize("count", [2, 7])
def test_num_samples_draws_that_many_records_as_llamafactory_does(tmp_path, count):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.jsonl", "num_samples": count}}))
    c = load(_yaml(tmp_path, dataset="a", dataset_dir="."))
    drawn = [r["text"] for _, r in records(c.data[0])]
    every = [r["text"] for r in data.texts(3)]
    assert len(drawn) == count and set(drawn) <= set(every)
    if count > 3:       # every record once, then drawn again at random
        assert sorted(drawn[:3]) == sorted(every)
    else:
        assert len(set(drawn)) == count
    assert drawn == [r["text"] for _, r in records(load(_yaml(tmp_path, dataset="a", dataset_dir=".")).data[0])]
    tok = files.tokenizer()
    assert tokens.token_file(str(tmp_path / "t"), "train", c.data, tok, None, False).n_docs == count
    c = load(_yaml(tmp_path, dataset="a", dataset_dir=".", max_samples=1))      # max_samples: the first drawn
    assert [r["text"] for _, r in records(c.data[0])] == drawn[:1]


@pytest.mark.parametrize("entry, settings, message", [
    ({"file_name": "a.jsonl", "num_sample": 5}, {}, "a in {tmp}/dataset_info.json has unknown key num_sample; "
                                                    "an entry takes file_name, formatting, ranking, columns, tags, "
                                                    "num_samples"),
    ({"file_name": "a.jsonl", "split": "test"}, {}, "has split 'test'; a local file is one split, train"),
    ({"file_name": "a.jsonl", "num_samples": 0}, {}, "num_samples of {tmp}/a.jsonl is a whole number >= 1 (records drawn from it); got 0"),
    ({"file_name": "a.jsonl", "num_samples": 5}, {"streaming": True}, "num_samples draws records from the whole"),
])
def test_dataset_info_entries_are_checked_by_name(tmp_path, entry, settings, message):
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": entry}))
    with pytest.raises(ArgumentError) as e:
        load(_yaml(tmp_path, dataset="a", dataset_dir=".", **settings))
    assert message.format(tmp=tmp_path) in str(e.value)
