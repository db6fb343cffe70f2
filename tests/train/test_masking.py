"""The loss counts the assistant's tokens of a conversation and a completion, checked against
masks written out by hand."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens
from tests.train import files

CHAT = [{"role": "system", "content": "it is late"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "i am fine"}, {"role": "user", "content": "what is the time now"},
        {"role": "assistant", "content": "it is late"}]


def _words(tok, ids):
    return tok.convert_ids_to_tokens(ids)


def test_only_assistant_turns_are_targets_of_a_conversation():
    tok = files.tokenizer()
    ids, targets = tokens.encode(tok, {"messages": CHAT}, False, "chats.jsonl:1")
    expected = [  # (token, counted by the loss)
        ("<|system|>", 0), ("it", 0), ("is", 0), ("late", 0), ("<|end|>", 0),
        ("<|user|>", 0), ("hello", 0), ("there", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("i", 1), ("am", 1), ("fine", 1), ("<|end|>", 1),
        ("<|user|>", 0), ("what", 0), ("is", 0), ("the", 0), ("time", 0), ("now", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("it", 1), ("is", 1), ("late", 1), ("<|end|>", 1),
        ("</s>", 1)]    # the EOS that closes the document, learned with the last turn
    assert list(zip(_words(tok, ids), map(int, targets))) == expected
    _, everything = tokens.encode(tok, {"messages": CHAT}, True, "chats.jsonl:1")
    assert all(everything)


def test_a_completion_is_the_target_and_its_prompt_is_not():
    tok = files.tokenizer()
    ids, targets = tokens.encode(tok, {"prompt": "what is the time", "completion": "it is late"}, False, "x:1")
    assert _words(tok, ids) == ["what", "is", "the", "time", "it", "is", "late", "</s>"]
    assert list(map(int, targets)) == [0, 0, 0, 0, 1, 1, 1, 1]
    _, targets = tokens.encode(tok, {"text": "the cat sat"}, False, "x:2")
    assert all(targets)


def test_records_that_cannot_be_masked_are_refused_with_their_line():
    tok = files.tokenizer()
    with pytest.raises(ArgumentError, match="x:3: a record is in none of the layouts read: text; messages; ShareGPT"):
        tokens.encode(tok, {"question": "?"}, False, "x:3")
    for text, held in ((None, "null"), (["a", "b"], "a list")):
        with pytest.raises(ArgumentError, match=f"x:5: text is {held}; a text record's text is a string"):
            tokens.encode(tok, {"text": text}, False, "x:5")
    tok.chat_template = None
    with pytest.raises(ArgumentError, match="x:4: records with messages need the tokenizer's chat template"):
        tokens.encode(tok, {"messages": CHAT}, False, "x:4")
    tok.chat_template = "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}"   # no prefix property
    with pytest.raises(ArgumentError, match="does not render the conversation up to turn 2 as a prefix"):
        tokens.encode(tok, {"messages": CHAT}, False, "x:5")


def test_data_whose_loss_would_count_nothing_is_refused(tmp_path):
    data = tmp_path / "asks.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hello there"}]}\n')
    with pytest.raises(ArgumentError, match="no token of the train data .* is counted by the loss"):
        tokens.token_file(str(tmp_path / "tokens"), "train", [str(data)], files.tokenizer(), None, False)
    assert not (tmp_path / "tokens" / "train.json").exists()     # no cache is left to be taken for one
    made = tokens.token_file(str(tmp_path / "tokens"), "train", [str(data)], files.tokenizer(), None, True)
    assert made.targets.all() and made.n_docs == 1


def test_a_template_that_writes_nothing_of_a_turns_text_is_refused():
    tok = files.tokenizer()
    # LLaVA's templates read list contents only ([{type: text, text: ...}]) and write nothing of a string
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {% for part in m['content'] | selectattr('type', "
                         "'equalto', 'text') %}{{ part['text'] }} {% endfor %}<|end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    with pytest.raises(ArgumentError, match="x:1: the chat template does not write turn 0 \\(role 'system'\\): the "
                                            "template must write each turn's text as it is"):
        tokens.encode(tok, {"messages": CHAT}, False, "x:1")
    # the reasoning a template drops from a turn (Qwen3's, after </think>) is not looked for
    tok.chat_template = files.TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'].split('</think>')[-1] }}")
    thought = [*CHAT[:2], {"role": "assistant", "content": "<think> i am fine </think> it is late"}]
    assert tokens.encode(tok, {"messages": thought}, False, "x:2") == tokens.encode(
        tok, {"messages": [*CHAT[:2], {"role": "assistant", "content": " it is late"}]}, False, "x:2")


def test_trls_conversational_prompt_completion_trains_the_completion_alone():
    tok = files.tokenizer()
    record = {"prompt": CHAT[:4], "completion": CHAT[4:]}      # an earlier answer in the prompt: not trained
    ids, targets = tokens.encode(tok, record, False, "x:1")
    whole_ids, whole = tokens.encode(tok, {"messages": CHAT}, False, "x:1")
    assert ids == whole_ids
    last = _words(tok, ids).index("<|assistant|>", 12)      # the completion's turn
    assert [bool(t) for t in targets] == [bool(t) and i > last for i, t in enumerate(whole)]
    assert sum(targets) == 5 and sum(whole) == 9          # "it is late <|end|>" and the EOS; "i am fine <|end|>" too
    assert all(tokens.encode(tok, record, True, "x:1")[1])
    with pytest.raises(ArgumentError, match="x:2: a prompt/completion record needs both, as strings or both as lists "
                                            "of messages"):
        tokens.encode(tok, {"prompt": CHAT[:4], "completion": "it is late"}, False, "x:2")
    with pytest.raises(ArgumentError, match="x:3: the completion holds no assistant turn"):
        tokens.encode(tok, {"prompt": CHAT[:3], "completion": [CHAT[3]]}, False, "x:3")
