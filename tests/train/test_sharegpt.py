"""ShareGPT records (`conversations` of {from, value}, human/gpt) train their gpt turns as
`messages` with user/assistant do; a file whose loss would count nothing is named with the roles
it holds: refused when no file trains anything, a warning when others do."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens
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
