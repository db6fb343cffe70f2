"""ShareGPT records (`conversations` of {from, value}, human/gpt) train their gpt turns as
`messages` with user/assistant do; a file whose loss would count nothing is named with the roles
it holds: refused when no file trains anything, a warning when others do. A dataset of
LlamaFactory's sharegpt formatting leaves out the conversations its converter skips, and says so."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import sharegpt, tokens
from tests.train import files

Q, A = "hello there how are you", "i am fine thank you"


def test_sharegpt_turns_are_mapped_to_the_roles_the_template_and_mask_know():
    tok = files.tokenizer()
    ours = tokens.encode(tok, {"messages": [{"role": "system", "content": "it is late"},
                                            {"role": "user", "content": Q},
                                            {"role": "assistant", "content": A}]}, False, "x:1")
    theirs = tokens.encode(tok, {"system": "it is late",
                                 "conversations": [{"from": "human", "value": Q}, {"from": "gpt", "value": A}]},
                           False, "x:2")
    assert theirs == ours
    assert sum(theirs[1]) > len(A.split())      # the answer and the turn's end count; the question does not


def _lines(path, *records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_data_whose_roles_the_loss_does_not_count_is_refused_naming_them(tmp_path):
    bot = {"messages": [{"role": "human", "content": Q}, {"role": "bot", "content": A}]}
    data = _lines(tmp_path / "bots.jsonl", bot, bot)
    with pytest.raises(ArgumentError, match=r"the roles seen are human \(2 turns\), bot \(2 turns\)"):
        tokens.token_file(str(tmp_path / "tokens"), "train", [data], files.tokenizer(), None, False)
    assert not (tmp_path / "tokens").exists() and not (tmp_path / "tokens.new").exists()


def test_a_file_that_trains_nothing_beside_others_that_do_is_named(tmp_path, capsys):
    bot = _lines(tmp_path / "bots.jsonl", {"conversations": [{"from": "human", "value": Q},
                                                             {"from": "bard", "value": A}]})
    good = files.chats(str(tmp_path / "chats.jsonl"))
    made = tokens.token_file(str(tmp_path / "tokens"), "train", [good, bot], files.tokenizer(), None, False)
    assert made.targets.any()
    out = capsys.readouterr().out
    assert "none of the" in out and f"tokens of {bot} is counted by the loss" in out
    assert "roles seen are human (1 turn), bard (1 turn)" in out and good not in out


def _turns(*roles: str) -> dict:
    return {"conversations": [{"from": r, "value": Q if r in ("human", "system") else A} for r in roles]}


# LlamaFactory's data/bad.json layouts: its ShareGPT converter skips all but the first and the last
BROKEN = [_turns("human", "gpt"), _turns("human", "gpt", "human"), _turns("human", "human", "gpt"),
          _turns("gpt", "human", "gpt"), _turns("system", "human", "gpt")]


@pytest.mark.parametrize("record, why", [
    (_turns("human", "gpt"), None),
    (_turns("system", "human", "gpt", "human", "gpt"), None),
    (_turns("human", "function_call", "observation", "gpt"), None),        # a tool's call and answer pair up too
    ({"messages": [{"role": "user", "content": Q}, {"role": "tool", "content": A}]}, sharegpt.UNPAIRED),
    (_turns("human", "gpt", "human"), sharegpt.UNANSWERED),
    (_turns("human", "human", "gpt"), sharegpt.UNPAIRED),
    (_turns("gpt", "human", "gpt"), sharegpt.UNPAIRED),
    (_turns("human", "bard"), sharegpt.UNKNOWN),
    (_turns("human", "gpt", "system", "human", "gpt"), sharegpt.UNKNOWN),
    (_turns("system"), sharegpt.EMPTY),
    ({**_turns("human"), "chosen": {"from": "gpt", "value": A}, "rejected": {"from": "gpt", "value": Q}}, None),
])
def test_the_conversations_llamafactory_skips_are_told_why(record, why):
    assert sharegpt.broken(record) == why


def test_a_llamafactory_sharegpt_dataset_skips_them_and_says_so(tmp_path, capsys):
    """As LlamaFactory's converter: a conversation whose turns do not pair up is left out, with a
    warning naming how many, why and the first of each; the same file given as data: is read as
    megacompile reads chats (every record trained)."""
    from megacompile.train import load
    (tmp_path / "bad.json").write_text(json.dumps(BROKEN))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"bad": {"file_name": "bad.json",
                                                                    "formatting": "sharegpt"}}))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), dataset="bad", dataset_dir=str(tmp_path), steps=2,
                            run_dir=str(tmp_path / "run")), [])
    made = tokens.token_file(str(tmp_path / "tokens"), "train", c.data, files.tokenizer(), None, False)
    path = tmp_path / "bad.json"
    assert made.n_docs == 2
    assert (f"3 of the 5 records of {path} skipped, as LlamaFactory's ShareGPT reading skips them: "
            f"1 {sharegpt.UNANSWERED} (the first: {path} row 1); 2 {sharegpt.UNPAIRED} (the first: {path} row 2)"
            ) in capsys.readouterr().out
    plain = load(files.run_yaml(str(tmp_path / "own.yaml"), data=str(path), steps=2, run_dir=str(tmp_path / "run")), [])
    assert tokens.token_file(str(tmp_path / "own"), "train", plain.data, files.tokenizer(), None, False).n_docs == 5
    assert "skipped" not in capsys.readouterr().out
