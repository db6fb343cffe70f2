"""A conversation is tokenised once and each assistant turn found by where its text lies (a fast
tokenizer's offsets): the masks are those of tokenising each rendering apart, on a byte-level BPE
whose merges cross turn boundaries, and where a token straddles a turn's start the turn is found
the slow way, which refuses as before."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens
from megacompile.train.data.masking import _at
from tests.train import files, processor_files

# ChatML's layout: newlines after the header and the end token, which a byte-level BPE merges
CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class _Apart:
    """The tokenizer as one that cannot say where its tokens lie (a Python tokenizer)."""
    is_fast = False

    def __init__(self, tok):
        self.tok, self.chat_template, self.eos_token_id = tok, tok.chat_template, tok.eos_token_id

    def __call__(self, text, add_special_tokens=True):
        return self.tok(text, add_special_tokens=add_special_tokens)

    def get_chat_template(self, tools=None):
        return self.tok.get_chat_template(tools=tools)

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)


def _conversations():
    s = files.SENTENCES
    yield [{"role": "user", "content": s[0]}, {"role": "assistant", "content": s[1]}]
    yield [{"role": "system", "content": s[2]}, {"role": "user", "content": s[3]},
           {"role": "assistant", "content": s[4] + "\n\n"}, {"role": "user", "content": "\n" + s[5]},
           {"role": "assistant", "content": " " + s[6]}]
    yield [{"role": "user", "content": s[7] + " "}, {"role": "assistant", "content": "\n\n" + s[8] + "\n"},
           {"role": "user", "content": s[9]}, {"role": "assistant", "content": s[0] + "?"}]


@pytest.mark.parametrize("template", [files.TEMPLATE, CHATML])
def test_the_masks_are_those_of_tokenising_each_rendering_apart(template):
    tok = processor_files.tokenizer([])
    tok.chat_template = template
    for k, messages in enumerate(_conversations()):
        record = {"messages": messages}
        try:
            apart = tokens.encode(_Apart(tok), record, False, f"x:{k}")
        except ArgumentError as e:
            with pytest.raises(ArgumentError, match="as a prefix of the whole"):
                tokens.encode(tok, record, False, f"x:{k}")
            assert "as a prefix of the whole" in str(e)
            continue
        assert tokens.encode(tok, record, False, f"x:{k}") == apart
        assert sum(apart[1]) > 0


def test_a_token_straddling_a_turns_start_is_not_split():
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12)]
    assert [_at(offsets, c) for c in (0, 3, 5, 9, 12)] == [0, 1, 2, 3, 5]
    assert _at(offsets, 4) is None and _at(offsets, 7) is None


def test_a_turn_whose_ends_fall_between_tokens_is_found_without_tokenising_again(monkeypatch):
    from megacompile.train.data import masking
    tok = processor_files.tokenizer([])
    tok.chat_template = CHATML
    apart = []
    encode = masking._encode
    monkeypatch.setattr(masking, "_encode", lambda *a, **k: apart.append(a[1]) or encode(*a, **k))
    messages = next(_conversations())
    assert sum(tokens.encode(tok, {"messages": messages}, False, "x:1")[1]) > 0
    assert apart == []      # only the whole conversation was tokenised (not through _encode)
