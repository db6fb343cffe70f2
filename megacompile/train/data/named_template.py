"""run.yaml's `template`: a chat layout by LlamaFactory's name, for the models whose own chat
template cannot be trained on as LlamaFactory trains them.

LlamaFactory formats a conversation by its named template; megacompile by the tokenizer's own
chat template (masking.py), which gives LlamaFactory's tokens for most models. Qwen3's does not:
its official template drops the think blocks of earlier answers once a later question follows,
so a multi-turn conversation cannot be split into its answers (masking.py refuses it), and
LlamaFactory's `qwen3` keeps every answer's think block (an empty one where the answer has none).
The names here are rendered by a template of our own that writes LlamaFactory's layout and marks
the assistant's text (`{% generation %}`, marks.py):

    qwen3           templates/qwen3.jinja: each answer with its think block; enable_thinking
                    (LlamaFactory's, default true) trains an added empty block with the answer,
                    false writes it before the answer as prompt and leaves out every thought
    qwen3_nothink   the same file with `reasoning` false: each turn's text as it is

As LlamaFactory's, both end an answer with <|im_end|>, which they make the tokenizer's EOS
(its replace_eos): no other EOS follows the conversation (encoding.py). The trained model is
written with its folder's own chat template (LlamaFactory writes the model's own template too)
and that EOS.
"""
from __future__ import annotations

import copy
import os

from ...errors import ArgumentError

STOP = "<|im_end|>"
NAMES = {"qwen3": ("qwen3.jinja", ""),
         "qwen3_nothink": ("qwen3.jinja", "{%- set reasoning = false -%}\n")}
_FOLDER = os.path.join(os.path.dirname(__file__), "templates")


def text(name: str) -> str:
    """The Jinja text the chats of template `name` are rendered with."""
    file, before = NAMES[name]
    with open(os.path.join(_FOLDER, file), encoding="utf-8") as f:
        return before + f.read()


def check(name) -> str:
    if name not in NAMES:
        raise ArgumentError(f"template {name!r}: megacompile renders LlamaFactory's {' and '.join(NAMES)} itself; "
                            "other models' chats are formatted by their tokenizer's own chat template: leave "
                            "template out, or give chat_template: FILE.jinja")
    return name


def apply(tokenizer, name: str):
    """`tokenizer` set to render template `name`, with its stop token as EOS (LlamaFactory's
    replace_eos); refused where the vocabulary has no such token."""
    stop = tokenizer.convert_tokens_to_ids(STOP)
    if stop is None or stop == tokenizer.unk_token_id:
        raise ArgumentError(f"template {name}: the tokenizer has no {STOP} token, with which this layout closes "
                            "each answer; it is Qwen's: give the model's own tokenizer (or leave template out)")
    tokenizer.chat_template = text(name)
    tokenizer.eos_token = STOP
    if tokenizer.pad_token is None:     # as LlamaFactory pads: with the EOS it set
        tokenizer.pad_token = STOP
    return tokenizer


def exported(tokenizer, folder: str):
    """What the trained model is written with: `tokenizer` (its EOS as apply() set it) holding its
    folder's own chat template again."""
    from transformers import AutoTokenizer
    out = copy.deepcopy(tokenizer)
    out.chat_template = AutoTokenizer.from_pretrained(folder).chat_template
    return out
