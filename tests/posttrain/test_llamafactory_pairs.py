"""LlamaFactory's pairwise datasets (dataset_info.json, ranking: true) under stage: dpo, alpaca and
sharegpt, read into the token ids DPO trains on: the prompt rendered by the chat template with its
generation prompt, each answer the assistant turn after it. A malformed record is refused naming
its file, its record and the fix."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.stages.dpo import DPOStage
from tests.posttrain import stage_files
from tests.train import files

ALPACA = {"instruction": "what is the time", "input": "now", "chosen": "it is late", "rejected": "i am fine",
          "system": "we like to read books", "history": [["hello there", "i am fine"]]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "i am fine"},
                              {"from": "human", "value": "what is the time now"}],
            "system": "we like to read books",
            "chosen": {"from": "gpt", "value": "it is late"}, "rejected": {"from": "gpt", "value": "i am fine"}}
PROMPT = ("<|system|> we like to read books <|end|> <|user|> hello there <|end|> <|assistant|> i am fine <|end|> "
          "<|user|> what is the time now <|end|> <|assistant|>")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return stage_files.workspace(tmp_path_factory.mktemp("llamafactory_pairs"))["model"]


def _stage(model, tmp_path, records: list[dict], formatting: str) -> tuple[DPOStage, str]:
    name = "pairs.json" if formatting == "alpaca" else "pairs.jsonl"
    path = tmp_path / name
    path.write_text(json.dumps(records) if name.endswith(".json") else "".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "dataset_info.json").write_text(json.dumps(
        {"prefs": {"file_name": name, "ranking": True, "formatting": formatting}}))
    settings = {**stage_files.dpo({"model": model, "pairs": None}, str(tmp_path / "run")), "seq": 48,
                "dataset": "prefs", "dataset_dir": str(tmp_path)}
    for key in ("data", "eval_fraction", "eval_every"):
        settings.pop(key)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    return DPOStage(c, files.tokenizer()), str(path)


def _ids(tok, words: str) -> tuple[int, ...]:
    ids = tok.convert_tokens_to_ids(words.split())
    assert tok.unk_token_id not in ids, words
    return tuple(ids)


@pytest.mark.parametrize("record, formatting", [(ALPACA, "alpaca"), (SHAREGPT, "sharegpt")])
def test_a_pairwise_dataset_gives_the_prompt_and_answer_tokens(model, tmp_path, record, formatting):
    tok = files.tokenizer()
    stage, _ = _stage(model, tmp_path, [record] * 2, formatting)
    assert [(p.prompt, p.chosen, p.rejected) for p in stage.pairs] == \
        [(_ids(tok, PROMPT), _ids(tok, "it is late <|end|>"), _ids(tok, "i am fine <|end|>"))] * 2


@pytest.mark.parametrize("record, formatting, where, message", [
    ({k: v for k, v in ALPACA.items() if k != "rejected"}, "alpaca", "row 1",
     "a record in LlamaFactory's alpaca ranking layout needs chosen and rejected; missing rejected: give each record "
     "both answers"),
    ({**ALPACA, "rejected": ALPACA["chosen"]}, "alpaca", "row 1", "chosen and rejected are the same completion"),
    ({**ALPACA, "chosen": ""}, "alpaca", "row 1", "chosen is empty; give the chosen completion's text"),
    ({**SHAREGPT, "conversations": SHAREGPT["conversations"][:2]}, "sharegpt", ":2",
     "in the sharegpt ranking layout the conversation ends with the user's turn or a tool's answer (observation; "
     "chosen and rejected answer it); its last turn is 'assistant'"),
    ({**SHAREGPT, "chosen": {"from": "human", "value": "it is late"}}, "sharegpt", ":2",
     "chosen is the model's turn (from: gpt, or role: assistant); got role 'user'"),
])
def test_a_malformed_pairwise_record_is_refused_naming_the_file_the_record_and_the_fix(model, tmp_path, record,
                                                                                      formatting, where, message):
    good = ALPACA if formatting == "alpaca" else SHAREGPT
    with pytest.raises(ArgumentError) as e:
        _stage(model, tmp_path, [good, record], formatting)
    path = str(tmp_path / ("pairs.json" if formatting == "alpaca" else "pairs.jsonl"))
    assert str(e.value).startswith(f"{path}{' ' if where.startswith('row') else ''}{where}: ")
    assert message in str(e.value)
