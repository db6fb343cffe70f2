"""stage: pt trains LlamaFactory's pretraining: each record read as the text LlamaFactory reads
(its first prompt turn), every token trained, no chat template; a .txt named in dataset_info.json
is a record a line, as datasets' text builder reads it."""
from __future__ import annotations

import json
import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from megacompile.train.data import pretrain, reading
from tests.train import files
from tests.train.killed import TIMED

TIMING = TIMED      # the measured columns, which differ run to run


def test_each_record_layout_is_read_as_the_text_llamafactory_pretrains_on():
    read = lambda r: pretrain.record(r, "x.jsonl line 1")["text"]      # noqa: E731
    assert read({"text": "the cat sat"}) == "the cat sat"
    # LlamaFactory's c4_demo: its text column renamed to the instruction by "columns": {"prompt": "text"}
    assert read({"instruction": "the cat sat"}) == "the cat sat"
    assert read({"instruction": "sum this", "input": "a dog ran", "output": "ok"}) == "sum this\na dog ran"
    assert read({"instruction": "", "input": "a dog ran"}) == "a dog ran"
    assert read({"instruction": "now", "history": [["first question", "its answer"]], "output": "x"}) == \
        "first question"
    # the first turn after the system prompt, as the conversation's own field or its first turn
    assert read({"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi"}],
                 "system": "be kind"}) == "hello there"
    assert read({"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "what now"},
                              {"role": "assistant", "content": "it is late"}]}) == "what now"


@pytest.mark.parametrize("record, words", [
    ({"prompt": "a", "completion": "b"}, "completion, prompt: name its text column"),
    ({"text": "a", "images": ["cat.png"]}, "has images, and stage pt trains text alone"),
    ({"messages": [{"role": "system", "content": "be kind"}]}, "no such turn of text"),
    ({"instruction": ["not", "text"]}, "instruction and input are strings"),
])
def test_a_record_without_a_text_is_refused_by_line(record, words):
    with pytest.raises(ArgumentError, match="x.jsonl line 3") as e:
        pretrain.record(record, "x.jsonl line 3")
    assert words in str(e.value)


def _llamafactory_data(folder: str) -> tuple[list[str], list[str]]:
    """dataset_info.json naming a c4-like .jsonl (text column as the prompt) and a wiki-like .txt;
    the texts each holds, in order."""
    os.makedirs(folder)
    c4 = [" ".join(files.SENTENCES[i:i + 3]) for i in range(8)]
    with open(os.path.join(folder, "c4.jsonl"), "w") as f:
        for t in c4:
            f.write(json.dumps({"text": t, "timestamp": "2019-04-25", "url": "u"}) + "\n")
    wiki = [" ".join(files.SENTENCES[i::3]) for i in range(3)] + ["", "it is late"]
    with open(os.path.join(folder, "wiki.txt"), "w") as f:
        f.write("\n".join(wiki) + "\n")
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"c4_demo": {"file_name": "c4.jsonl", "columns": {"prompt": "text"}},
                   "wiki_demo": {"file_name": "wiki.txt", "columns": {"prompt": "text"}},
                   "pairs": {"file_name": "c4.jsonl", "ranking": True}}, f)
    return c4, wiki


def test_a_txt_named_in_dataset_info_is_a_record_a_line(tmp_path):
    made = files.workspace(tmp_path)
    c4, wiki = _llamafactory_data(str(tmp_path / "data"))
    c = load(files.run_yaml(str(tmp_path / "lf.yaml"), model_name_or_path="model", stage="pt",
                            dataset="c4_demo,wiki_demo", cutoff_len=16, max_steps=1, device="cpu"))
    assert [e["kind"] for e in c.data] == ["jsonl", "lines"]
    assert all(e["pretrain"] for e in c.data)
    read = [list(reading.records(e)) for e in c.data]
    assert [r["text"] for _, r in read[0]] == c4
    assert [r for _, r in read[1]] == [{"text": t} for t in wiki]       # the empty line too, as datasets reads it
    assert read[1][3][0].endswith("wiki.txt line 4")
    # a .txt given by path is one document, under any stage
    c = load(files.run_yaml(str(tmp_path / "own.yaml"), model="model", data=made["notes"], stage="pt", seq=16,
                            steps=1, device="cpu"))
    assert c.data[0]["kind"] == "text" and len(list(reading.records(c.data[0]))) == 1


def _rows(run_dir: str) -> list[dict]:
    from megacompile.train.log import read
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read(os.path.join(run_dir, "log.csv"))]


def test_llamafactory_pretraining_trains_as_the_same_texts_given_as_text_records(tmp_path, capsys, monkeypatch):
    files.workspace(tmp_path)
    c4, wiki = _llamafactory_data(str(tmp_path / "data"))
    for name, texts in (("c4_texts.jsonl", c4), ("wiki_texts.jsonl", wiki)):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-3, max_steps=4,
                  logging_steps=1, seed=5, bf16=False, device="cpu")
    lf = files.run_yaml(str(tmp_path / "lf.yaml"), model_name_or_path="model", stage="pt", do_train=True,
                        dataset="c4_demo,wiki_demo", template="llama3", cutoff_len=16, output_dir="saves/lf",
                        overwrite_output_dir=True, **common)
    own = files.run_yaml(str(tmp_path / "own.yaml"), model="model", data=["c4_texts.jsonl", "wiki_texts.jsonl"],
                         seq=16, run_dir="saves/own", **common)
    run(load(lf))
    said = capsys.readouterr().out
    assert "stage pt: each record is one text" in said and "template 'llama3' is not read" in said
    assert "loss           pt: the cross-entropy of every token" in said
    run(load(own))
    lf_rows, own_rows = _rows(str(tmp_path / "saves/lf")), _rows(str(tmp_path / "saves/own"))
    assert len(lf_rows) == 4 and lf_rows == own_rows
    # the same records under stage sft (the tokenizer's own chat template: this one has no llama3
    # tokens) are Alpaca instructions without an answer: not text
    # Refused, the run leaves nothing: not its folder, nor the folders above it it made (an override's
    # path is the working folder's).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ArgumentError, match="none of the layouts read"):
        run(load(lf, ["stage=sft", "output_dir=saves/sft", "template=null"]))
    assert os.listdir(elsewhere) == []


def test_what_stage_pt_does_not_take_is_said(tmp_path, capsys):
    made = files.workspace(tmp_path)
    _llamafactory_data(str(tmp_path / "data"))
    yaml = files.run_yaml(str(tmp_path / "pt.yaml"), model="model", data=made["chats"], stage="pt", seq=16,
                          steps=1, device="cpu")
    with pytest.raises(ArgumentError, match="stage pt trains the cross-entropy of every token.*loss_type 'dft'"):
        load(yaml, ["loss_type=dft"])
    ranking = files.run_yaml(str(tmp_path / "ranking.yaml"), model="model", dataset="pairs", stage="pt", seq=16,
                             steps=1, device="cpu")
    with pytest.raises(ArgumentError, match="ranking .* stage pt reads text"):
        load(ranking)
    with pytest.raises(ArgumentError, match="stage 'ppo' is not supported.*sft \\(the default\\), pt, dpo, kto, rm or grpo"):
        load(yaml, ["stage=ppo"])
    capsys.readouterr()
    load(yaml, ["train_on_prompt=true", "mask_history=true"])
    assert "train_on_prompt, mask_history are not used under stage pt" in capsys.readouterr().out
