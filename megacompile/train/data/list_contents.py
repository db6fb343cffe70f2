"""String contents made into lists of parts, for a chat template that reads only list contents.

llava-hf's template writes a turn's `{"type": "image"}` and `{"type": "text"}` parts and nothing
of a string, while LlamaFactory's records hold strings with `<image>` (`<video>`) placeholders
(LlamaFactory renders them with its own `template: llava`). For such a template each string
content becomes the parts it stands for, as transformers' processors and TRL lay them out: its
text between the placeholders as text parts, each placeholder as an image (video) part, in order,

    "<image>What is in the picture?"  ->  [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]

and a string without placeholders (an answer) as its one text part. A template that writes a
string's text keeps the strings as they are. A turn with tool calls keeps its content (masking.py
reads it as a string).
"""
from __future__ import annotations

import re

_PROBE = "megacompile-probe-7f3a"
_READS: dict[str, bool] = {}     # template text -> whether it reads only list contents


def _writes(tokenizer, content) -> bool:
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that fails here writes nothing of it
        return False
    return isinstance(text, str) and _PROBE in text


def reads_lists_only(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a text part's text and nothing of a string's."""
    try:
        template = tokenizer.get_chat_template()
    except Exception:  # noqa: BLE001 - no template: masking.chat refuses the record with its line
        return False
    if not isinstance(template, str):
        return False
    if template not in _READS:
        _READS[template] = (not _writes(tokenizer, _PROBE)
                            and _writes(tokenizer, [{"type": "text", "text": _PROBE}]))
    return _READS[template]


def parts_of(text: str, kinds: dict[str, str]) -> list[dict]:
    """`text` as parts: `kinds` maps each placeholder (`<image>`) to its part's type (`image`)."""
    found = re.split("(" + "|".join(map(re.escape, kinds)) + ")", text)
    return [{"type": kinds[piece]} if piece in kinds else {"type": "text", "text": piece}
            for piece in found if piece]


def as_parts(messages: list, kinds: dict[str, str]) -> list:
    """Each turn's string content as its parts (parts_of); other turns as they are."""
    return [{**m, "content": parts_of(m["content"], kinds)}
            if isinstance(m, dict) and isinstance(m.get("content"), str) and not m.get("tool_calls") else m
            for m in messages]
