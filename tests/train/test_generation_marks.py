"""A chat template that marks the assistant's text ({% generation %}) is masked by its marks, exactly,
even where it renders an earlier turn differently once later ones follow (Qwen3's think block), which
the prefix rendering cannot split; marks that do not pair up with the turns are refused."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens
from tests.train import files

# Qwen3's way, in the test tokenizer's words: an assistant turn after the last user turn opens with
# a think block (empty when it has no reasoning), one before it does not.
_LAST_USER = ("{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
              "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}")
_ANSWER = ("{% if loop.index0 > ns.last %}<think> {{ m['content'].split('</think>')[0].split('<think>')[-1].strip() }} "
           "</think> {% endif %}{{ m['content'].split('</think>')[-1].strip() }} <|end|> ")
THINKING = (_LAST_USER + "{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}" + _ANSWER
            + "{% else %}{{ m['content'] }} <|end|> {% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|> {% endif %}")
MARKED = THINKING.replace(_ANSWER, "{% generation %}" + _ANSWER + "{% endgeneration %}")

CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"},
        {"role": "user", "content": "what is the time now"},
        {"role": "assistant", "content": "<think> it is late </think> the time is now"}]


def _tokenizer(template: str):
    return files.tokenizer(special=["<think>", "</think>"], template=template)


def _pairs(tok, ids, targets):
    return list(zip(tok.convert_ids_to_tokens(ids), map(int, targets)))


def test_a_template_that_drops_an_earlier_turns_think_block_is_refused_unmarked():
    with pytest.raises(ArgumentError, match="x:1: .* up to turn 1 as a prefix .* marks the assistant's text with "
                                            r"\{% generation %\}"):
        tokens.encode(_tokenizer(THINKING), {"messages": CHAT}, False, "x:1")


def test_the_marks_say_which_tokens_are_the_assistants():
    tok = _tokenizer(MARKED)
    ids, targets = tokens.encode(tok, {"messages": CHAT}, False, "x:1")
    assert _pairs(tok, ids, targets) == [
        ("<|user|>", 0), ("hello", 0), ("there", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("i", 1), ("am", 1), ("fine", 1), ("<|end|>", 1),     # no think block: not last
        ("<|user|>", 0), ("what", 0), ("is", 0), ("the", 0), ("time", 0), ("now", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("<think>", 1), ("it", 1), ("is", 1), ("late", 1), ("</think>", 1),
        ("the", 1), ("time", 1), ("is", 1), ("now", 1), ("<|end|>", 1), ("</s>", 1)]
    # the same tokens as the template renders the whole conversation
    whole = tok.apply_chat_template(CHAT, tokenize=False)
    assert ids[:-1] == list(tok(whole, add_special_tokens=False)["input_ids"])
    _, last = tokens.encode(tok, {"messages": CHAT}, False, "x:1", mask_history=True)
    assert list(map(int, last)) == [0] * 17 + [1] * 11       # mask_history: the last answer alone
    _, everything = tokens.encode(tok, {"messages": CHAT}, True, "x:1")
    assert all(everything)


def test_a_prompt_completion_conversation_trains_the_marked_completion_alone():
    tok = _tokenizer(MARKED)
    ids, targets = tokens.encode(tok, {"prompt": CHAT[:3], "completion": CHAT[3:]}, False, "x:1")
    assert [w for w, t in _pairs(tok, ids, targets) if t] == [
        "<think>", "it", "is", "late", "</think>", "the", "time", "is", "now", "<|end|>", "</s>"]


def test_marks_that_do_not_pair_up_with_the_turns_are_refused():
    last_only = MARKED.replace("{% generation %}", "{% if loop.last %}{% generation %}").replace(
        "{% endgeneration %}", "{% endgeneration %}{% else %}" + _ANSWER + "{% endif %}")
    with pytest.raises(ArgumentError, match="x:2: the chat template marks 1 stretch of the assistant's text .* "
                                            "of 2 assistant turns"):
        tokens.encode(_tokenizer(last_only), {"messages": CHAT}, False, "x:2")
    # a mark around the header alone holds none of the turn's text
    header = THINKING.replace("<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}",
                              "{% if m['role'] == 'assistant' %}{% generation %}<|assistant|> {% endgeneration %}"
                              "{% else %}<|{{ m['role'] }}|> {% endif %}{% if m['role'] == 'assistant' %}")
    with pytest.raises(ArgumentError, match="x:3: the chat template's mark for assistant turn 1 .* does not hold"):
        tokens.encode(_tokenizer(header), {"messages": CHAT}, False, "x:3")


def test_marks_are_read_with_a_fast_tokenizer_only():
    tok = _tokenizer(MARKED)

    class Slow:     # what a Python tokenizer (no tokenizer.json) answers
        is_fast = False
        chat_template = tok.chat_template

        def get_chat_template(self, tools=None):
            return tok.get_chat_template(tools=tools)

        def apply_chat_template(self, *a, **k):
            return tok.apply_chat_template(*a, **k)

    with pytest.raises(ArgumentError, match="x:4: .* reading the marks needs a fast tokenizer"):
        tokens.encode(Slow(), {"messages": CHAT}, False, "x:4")


def test_a_run_trains_with_the_template_file_it_is_given_and_writes_its_model_with_it(tmp_path):
    """TRL's chat_template_path: a model whose own template cannot be masked (Qwen3's way) trains on
    conversations of two answers with a marked template file; the token file holds what the marks
    say and the trained model's folder carries the template it was trained with."""
    import numpy as np
    from transformers import AutoTokenizer

    from megacompile.train import load, run
    model = files.model_dir(str(tmp_path / "model"), tok=_tokenizer(THINKING))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(4)))
    (tmp_path / "marked.jinja").write_text(MARKED)
    common = dict(model=model, data=str(data), seq=32, batch=2, steps=2, lr=1e-3, log="csv", device="cpu",
                  compute_dtype="float32")
    with pytest.raises(ArgumentError, match="chats.jsonl:1: .* as a prefix of the whole"):
        run(load(files.run_yaml(str(tmp_path / "own.yaml"), run_dir="own", **common), []))
    run(load(files.run_yaml(str(tmp_path / "run.yaml"), run_dir="run", chat_template_path="marked.jinja", **common),
             []))
    ids, targets = tokens.encode(_tokenizer(MARKED), {"messages": CHAT}, False, "x")
    held = tmp_path / "run" / "tokens"
    assert np.fromfile(held / "train.ids", dtype=np.uint32).tolist() == ids * 4
    assert np.fromfile(held / "train.targets", dtype=np.uint8).tolist() == list(map(int, targets)) * 4
    assert AutoTokenizer.from_pretrained(str(tmp_path / "run")).chat_template == MARKED


@pytest.mark.parametrize("given, message", [
    ("missing.jinja", "chat_template: .*missing.jinja"),
    ("empty.jinja", "chat_template: .*empty.jinja is empty"),
    ("broken.jinja", "chat_template: .*broken.jinja is not a valid Jinja template: line 1"),
    ("folder", "chat_template: .*folder holds no chat template"),
])
def test_a_template_file_that_cannot_be_read_is_refused_before_the_data(tmp_path, given, message):
    from megacompile.train import load
    (tmp_path / "empty.jinja").write_text("\n")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ArgumentError, match=message):
        load(files.run_yaml(str(tmp_path / "run.yaml"), model=files.model_dir(str(tmp_path / "model")),
                            data=files.chats(str(tmp_path / "chats.jsonl")), chat_template=given), [])


def test_a_folder_gives_the_template_of_its_tokenizer(tmp_path):
    from megacompile.train.data import template_file
    _tokenizer(MARKED).save_pretrained(str(tmp_path / "tok"))
    assert template_file.read(str(tmp_path / "tok")) == MARKED
    (tmp_path / "named.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                                       {"name": "default", "template": MARKED}]}))
    assert template_file.read(str(tmp_path / "named.json")) == MARKED
