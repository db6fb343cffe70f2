"""run.yaml's `template`: a chat layout by LlamaFactory's name, for the models whose own chat
template does not write what LlamaFactory trains.

LlamaFactory formats a conversation by its named template; megacompile by the tokenizer's own
chat template (masking.py), which gives LlamaFactory's tokens for many models, not all: Llama
3.1's and later write a system block of knowledge dates into every conversation, which
LlamaFactory's `llama3` does not; Qwen3's drops the think blocks of earlier answers once a later
question follows and DeepSeek-R1's drops every answer's, so a conversation cannot be split into
its answers (masking.py refuses it), while LlamaFactory's `qwen3` and `deepseekr1` keep every
answer's think block (an empty one where the answer has none). The names here are rendered by
templates of our own that write LlamaFactory's layout and mark the assistant's text
(`{% generation %}`, marks.py):

    qwen3           templates/qwen3.jinja: each answer with its think block; enable_thinking
                    (LlamaFactory's, default true) trains an added empty block with the answer,
                    false writes it before the answer as prompt and leaves out every thought;
                    under mask_history (LlamaFactory's discarding_history_cot) the earlier answers
                    lose their think blocks and the last alone takes the empty one, unless the
                    chat template's preserve_thinking (LlamaFactory's key) is true;
                    <|im_end|> closes each answer and becomes the EOS (its replace_eos)
    qwen3_nothink   the same file with `reasoning` false: each turn's text as it is
    deepseekr1      templates/deepseekr1.jinja: deepseek3's slots (BOS, <｜User｜>, <｜Assistant｜>,
                    the tokenizer's EOS after each answer) with qwen3's think blocks
    llama3          templates/llama3.jinja: Llama 3's headers, without the system block of
                    knowledge dates that Llama 3.1's own template writes into every conversation
                    (LlamaFactory writes none); <|eot_id|> closes each turn and becomes the EOS

A conversation closed by the EOS takes no other (encoding.py). The trained model is written with
its folder's own chat template (LlamaFactory writes the model's own template too) and the EOS
the layout made.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from ...errors import ArgumentError


@dataclass(frozen=True)
class Layout:
    file: str
    before: str = ""                # Jinja set ahead of the file's text
    eos: str | None = None          # made the tokenizer's EOS (LlamaFactory's replace_eos)
    tokens: tuple[str, ...] = ()    # what the layout writes as single tokens: the vocabulary must hold them


QWEN = ("<|im_start|>", "<|im_end|>")
NAMES = {"qwen3": Layout("qwen3.jinja", eos="<|im_end|>", tokens=QWEN),
         "qwen3_nothink": Layout("qwen3.jinja", "{%- set reasoning = false -%}\n", eos="<|im_end|>", tokens=QWEN),
         "deepseekr1": Layout("deepseekr1.jinja", tokens=("<｜User｜>", "<｜Assistant｜>")),
         "llama3": Layout("llama3.jinja", eos="<|eot_id|>",
                          tokens=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))}
_FOLDER = os.path.join(os.path.dirname(__file__), "templates")


def text(name: str) -> str:
    """The Jinja text the chats of template `name` are rendered with."""
    layout = NAMES[name]
    with open(os.path.join(_FOLDER, layout.file), encoding="utf-8") as f:
        return layout.before + f.read()


def check(name) -> str:
    if name not in NAMES:
        raise ArgumentError(f"template {name!r}: megacompile renders LlamaFactory's {', '.join(NAMES)} itself; "
                            "other models' chats are formatted by their tokenizer's own chat template: leave "
                            "template out, or give chat_template: FILE.jinja")
    return name


def apply(tokenizer, name: str):
    """`tokenizer` set to render template `name`, with the layout's EOS; refused where the
    vocabulary lacks a token the layout writes, or the EOS it closes answers with."""
    layout = NAMES[name]
    missing = [f"{t} token" for t in layout.tokens
               if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if layout.eos is None and tokenizer.eos_token is None:
        missing.append("EOS token")
    if missing:
        raise ArgumentError(f"template {name}: the tokenizer has no {' and no '.join(missing)}, which this layout "
                            "writes: give the model's own tokenizer (or leave template out)")
    tokenizer.chat_template = text(name)
    if layout.eos is not None:
        tokenizer.eos_token = layout.eos
    if tokenizer.pad_token is None:     # as LlamaFactory pads: with the EOS
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def exported(tokenizer, folder: str):
    """What the trained model is written with: `tokenizer` (its EOS as apply() set it) holding its
    folder's own chat template again."""
    from transformers import AutoTokenizer
    out = copy.deepcopy(tokenizer)
    out.chat_template = AutoTokenizer.from_pretrained(folder).chat_template
    return out
