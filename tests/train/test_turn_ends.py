"""A conversation closed by a token its model stops generating at is trained as its template wrote
it: Gemma's answers end with <end_of_turn>, which its generation_config.json names among the
eos_token_id it stops at while its tokenizer's EOS is <eos>. TRL adds nothing after such a
conversation (LlamaFactory's gemma layout makes <end_of_turn> the EOS); without the generation
config the EOS is added, as before."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens, turn_ends
from tests.train import files

GEMMA = ("{% for m in messages %}<start_of_turn> {{ m['role'] }} {{ m['content'] }} <end_of_turn> {% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn> assistant {% endif %}")
CHAT = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}]}


def _folder(tmp_path, stops=None):
    """A tokenizer folder with Gemma's layout; `stops`: generation_config.json's eos_token_id."""
    tok = files.tokenizer(["user", "assistant"], ["<start_of_turn>", "<end_of_turn>"], GEMMA)
    folder = tmp_path / "model"
    tok.save_pretrained(folder)
    if stops is not None:
        ids = {"eos": tok.eos_token_id, "turn": tok.convert_tokens_to_ids("<end_of_turn>")}
        value = [ids[s] for s in stops] if isinstance(stops, list) else ids.get(stops, stops)
        (folder / turn_ends.FILE).write_text(json.dumps({"eos_token_id": value}))
    return str(folder)


@pytest.mark.parametrize("stops", [["eos", "turn"], "turn"])
def test_a_chat_closed_by_a_token_generation_stops_at_takes_no_eos(tmp_path, stops):
    tok = tokens.load_tokenizer(_folder(tmp_path, stops))
    ids, targets = tokens.encode(tok, CHAT, False, "x:1")
    assert tok.convert_ids_to_tokens(ids[-4:]) == ["i", "am", "fine", "<end_of_turn>"]
    assert targets[-4:] == [True] * 4 and not targets[0]
    ids, _ = tokens.encode(tok, {"text": "hello there"}, False, "x:2")    # text: still closed by the EOS
    assert ids[-1] == tok.eos_token_id


def test_without_the_generation_config_or_with_the_eos_alone_the_eos_is_added(tmp_path):
    for stops, where in ((None, "none"), (["eos"], "eos")):
        tok = tokens.load_tokenizer(_folder(tmp_path / where, stops))
        ids, targets = tokens.encode(tok, CHAT, False, "x:1")
        assert tok.convert_ids_to_tokens(ids[-2:]) == ["<end_of_turn>", "</s>"] and targets[-1]


def test_the_generation_config_is_part_of_a_token_files_key(tmp_path):
    folder = _folder(tmp_path, ["eos"])
    data = files.chats(str(tmp_path / "chats.jsonl"))
    before = tokens.fingerprint([data], folder, False)
    (tmp_path / "model" / turn_ends.FILE).write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert tokens.fingerprint([data], folder, False) != before


def test_the_model_folders_generation_config_counts_where_the_tokenizer_is_another_folders(tmp_path):
    """`tokenizer:` names a folder of its own: the model folder's generation_config.json still says
    where its answers end, as generation reads it there, and joins the token files' key."""
    tokenizer = _folder(tmp_path / "tok")                 # no generation config of its own
    model = tmp_path / "weights"
    model.mkdir()
    turn = tokens.load_tokenizer(tokenizer).convert_tokens_to_ids("<end_of_turn>")
    (model / turn_ends.FILE).write_text(json.dumps({"eos_token_id": [turn]}))
    tok = tokens.load_tokenizer(tokenizer, model=str(model))
    assert turn in turn_ends.of(tok)
    ids, _ = tokens.encode(tok, CHAT, False, "x:1")
    assert tok.convert_ids_to_tokens(ids[-1:]) == ["<end_of_turn>"]       # no EOS after the turn's end
    data = files.chats(str(tmp_path / "chats.jsonl"))
    alone = tokens.fingerprint([data], tokenizer, False)
    assert tokens.fingerprint([data], tokenizer, False, model_dir=tokenizer) == alone    # one folder: as before
    before = tokens.fingerprint([data], tokenizer, False, model_dir=str(model))
    assert before != alone
    (model / turn_ends.FILE).write_text(json.dumps({"eos_token_id": [turn, 3]}))
    assert tokens.fingerprint([data], tokenizer, False, model_dir=str(model)) != before


@pytest.mark.parametrize("text, told", [("{not json", "cannot be read as JSON"),
                                        ('{"eos_token_id": "<end_of_turn>"}', "a token id or a list"),
                                        ('{"eos_token_id": [1, true]}', "a token id or a list")])
def test_a_generation_config_that_names_no_ids_is_refused_by_name(tmp_path, text, told):
    folder = _folder(tmp_path)
    (tmp_path / "model" / turn_ends.FILE).write_text(text)
    with pytest.raises(ArgumentError, match=told) as e:
        tokens.load_tokenizer(folder)
    assert turn_ends.FILE in str(e.value)
