"""TRL's assistant_only_loss and completion_only_loss are two settings, each for its record layouts,
as TRL 1.16's SFTTrainer reads them: the targets megacompile makes are checked against TRL's rule
derived here on its own: a prompt/completion record's completion mask (the tokens past the prompt,
the prompt of a conversation rendered with the generation prompt) where completion_only_loss is
true or null, transformers' assistant mask (return_assistant_tokens_mask, a template with
{% generation %} marks) where assistant_only_loss is true; a token is a target where every
applied mask holds it, and every token where none applies. A key not given keeps megacompile's
default (the assistant's turns of a conversation, the completion), which is TRL's true for both."""
from __future__ import annotations

import itertools

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.data import tokens
from tests.train import files

CHAT = [{"role": "system", "content": "it is late"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "i am fine"}, {"role": "user", "content": "what is the time now"},
        {"role": "assistant", "content": "it is late"}]
# files.TEMPLATE with the assistant's text marked, as TRL's training templates mark it
MARKED = ("{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}{% generation %}"
          "{{ m['content'] }} <|end|>{% endgeneration %}{% else %}{{ m['content'] }} <|end|>{% endif %} {% endfor %}"
          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
RECORDS = {"messages": {"messages": CHAT},
           "prompt/completion": {"prompt": "what is the time", "completion": " it is late"},
           "conversational prompt/completion": {"prompt": CHAT[:4], "completion": CHAT[4:]},
           "completion of several turns": {"prompt": CHAT[:2], "completion": CHAT[2:]}}
SETTINGS = [None, True, False]


def _common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _trl(record: dict, completion_only: bool | None, assistant_only: bool | None) -> tuple[list, list]:
    """TRL's input_ids and targets (sft_trainer.py's tokenize_fn and build_labels); a key not given
    is megacompile's default, true for both."""
    completion_only, assistant_only = completion_only is not False, assistant_only is not False
    tok = files.tokenizer(template=MARKED)
    masks = []
    if "messages" in record:
        out = tok.apply_chat_template(record["messages"], return_dict=True, return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        if assistant_only:
            masks.append(out["assistant_masks"])
    elif isinstance(record["prompt"], list):
        head = tok.apply_chat_template(record["prompt"], add_generation_prompt=True, return_dict=True)["input_ids"]
        out = tok.apply_chat_template(record["prompt"] + record["completion"], return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids = list(out["input_ids"])
        if completion_only:
            n = _common(list(head), ids)
            masks.append([0] * n + [1] * (len(ids) - n))
        if assistant_only:
            masks.append(out["assistant_masks"])
    else:       # TRL refuses assistant_only_loss: true here (not conversational); megacompile reads it as nothing
        head = tok(record["prompt"])["input_ids"]
        ids = list(tok(record["prompt"] + record["completion"])["input_ids"])
        if completion_only:
            n = _common(list(head), ids)
            masks.append([0] * n + [1] * (len(ids) - n))
    return ids, [all(bits) for bits in zip(*masks)] if masks else [True] * len(ids)


def _given(completion_only, assistant_only) -> dict:
    return {k: v for k, v in (("completion_only_loss", completion_only), ("assistant_only_loss", assistant_only))
            if v is not None}


@pytest.mark.parametrize("layout", list(RECORDS))
@pytest.mark.parametrize("completion_only, assistant_only", list(itertools.product(SETTINGS, SETTINGS)))
@pytest.mark.parametrize("template", [files.TEMPLATE, MARKED], ids=["plain template", "marked template"])
def test_each_key_trains_what_trl_trains_for_each_layout(layout, completion_only, assistant_only, template):
    tok = files.tokenizer(template=template)
    record = RECORDS[layout]
    ids, targets = tokens.encode(tok, record, False, "x:1", **_given(completion_only, assistant_only))
    want_ids, want = _trl(record, completion_only, assistant_only)
    assert ids[-1] == tok.eos_token_id and ids[:-1] == want_ids      # megacompile closes the document with EOS
    got = [bool(t) for t in targets[:-1]]
    assert list(zip(tok.convert_ids_to_tokens(want_ids), got)) == list(zip(tok.convert_ids_to_tokens(want_ids), want))
    assert bool(targets[-1]) == got[-1]       # the EOS is learned with the last token


def test_the_combinations_that_differ_from_megacompiles_default():
    tok = files.tokenizer()
    words = lambda record, **given: " ".join(t for t, on in zip(tok.convert_ids_to_tokens(  # noqa: E731
        tokens.encode(tok, record, False, "x:1", **given)[0]), tokens.encode(tok, record, False, "x:1", **given)[1])
        if on)
    chat, pc, conv = RECORDS["messages"], RECORDS["prompt/completion"], RECORDS["completion of several turns"]
    assert words(chat) == words(chat, completion_only_loss=False) == "i am fine <|end|> it is late <|end|> </s>"
    assert words(chat, assistant_only_loss=False).startswith("<|system|> it is late <|end|> <|user|>")    # every token
    assert words(pc) == words(pc, assistant_only_loss=False) == "it is late </s>"     # TRL's dump: the completion
    assert words(pc, completion_only_loss=False) == "what is the time it is late </s>"
    assert words(conv) == "i am fine <|end|> it is late <|end|> </s>"
    # the whole completion, its user turn among it, from the first answer on
    assert words(conv, assistant_only_loss=False) == "i am fine <|end|> <|user|> what is the time now <|end|> " \
                                                     "<|assistant|> it is late <|end|> </s>"
    assert words(RECORDS["conversational prompt/completion"], completion_only_loss=False) == words(chat)
    # train_on_prompt (LlamaFactory's) trains every token whatever TRL's keys say
    assert all(tokens.encode(tok, conv, True, "x:1", assistant_only_loss=False, completion_only_loss=False)[1])


def _config(tmp_path, records: list[dict], **settings):
    import json
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    model = files.model_dir(str(tmp_path / "model"))
    return load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, data="d.jsonl", run_dir="run", steps=1,
                               **settings), [])


def test_a_trl_dumps_assistant_only_loss_false_leaves_the_completion_alone_trained(tmp_path):
    # every SFTConfig().to_dict() holds assistant_only_loss: false and completion_only_loss: null
    c = _config(tmp_path, [RECORDS["prompt/completion"], RECORDS["messages"]], assistant_only_loss=False,
                completion_only_loss=None)
    assert (c.train_on_prompt, c.assistant_only_loss, c.completion_only_loss) == (False, False, None)
    tok = files.tokenizer()
    for n in (1, 2):        # tokenize_workers: the workers read the entry's keys too
        made = tokens.token_file(str(tmp_path / f"tokens{n}"), "train", c.data, tok, c.model, c.train_on_prompt,
                                 workers=n)
        first = made.ids[made.docs[0]:made.docs[1]]
        assert list(made.targets[made.docs[0]:made.docs[1]]) == [0] * 4 + [1] * 4
        assert len(first) == 8 and made.targets[made.docs[1]:made.docs[2]].all()      # the conversation: every token
    assert tokens.sources(tokens.fingerprint(c.data, c.model, False))["files"][0]["assistant_only_loss"] is False
    c = _config(tmp_path, [RECORDS["prompt/completion"]])
    assert "assistant_only_loss" not in tokens.sources(tokens.fingerprint(c.data, c.model, False))["files"][0]


def test_the_two_keys_are_two_settings(tmp_path):
    c = _config(tmp_path, [RECORDS["prompt/completion"]], completion_only_loss=True, assistant_only_loss=False)
    assert (c.train_on_prompt, c.completion_only_loss, c.assistant_only_loss) == (False, True, False)
    assert (c.data[0]["completion_only_loss"], c.data[0]["assistant_only_loss"]) == (True, False)
    c = _config(tmp_path, [RECORDS["prompt/completion"]], train_on_prompt=True, assistant_only_loss=False)
    assert c.train_on_prompt is True
    with pytest.raises(ArgumentError, match="train_on_prompt: true trains every token, and assistant_only_loss: true "
                                            "only the assistant turns: give one of them"):
        _config(tmp_path, [RECORDS["messages"]], train_on_prompt=True, assistant_only_loss=True)
    with pytest.raises(ArgumentError, match="completion_only_loss must be true or false; got 'yes'"):
        _config(tmp_path, [RECORDS["messages"]], completion_only_loss="yes")
