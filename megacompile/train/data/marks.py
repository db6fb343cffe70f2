"""The assistant's tokens as a chat template marks them: `{% generation %} ... {% endgeneration %}`
around what the model writes (transformers' `return_assistant_tokens_mask`, which TRL's
`assistant_only_loss` reads). Where a template marks its turns the marks are exact whatever it
does to earlier turns once later ones follow: Qwen3's template drops a turn's think block then,
so no rendering of the conversation's start finds the turn inside the whole (masking.py's way),
while a training template with the marks (TRL's for Qwen3, or the model's own with the two tags
added) says where each turn lies in the whole conversation as it is rendered.
"""
from __future__ import annotations

import re

from ...errors import ArgumentError
from ...posttrain import render, texts

_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def marked(tokenizer, tools: list | None) -> bool:
    """Whether the template this conversation is rendered with marks the assistant's text."""
    try:
        template = tokenizer.get_chat_template(tools=tools or None)
    except Exception:  # noqa: BLE001 - no template (masking.chat refuses that), or no named one for tools
        return False
    return isinstance(template, str) and bool(_MARK.search(template))


def without_marks(template: str) -> str:
    """The template with its generation tags left out (what plain Jinja parses)."""
    return _TAGS.sub("", template)


def blocks(tokenizer, messages: list, text: str, options: dict,
           where: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The conversation's tokens and the [start, end) tokens of each assistant turn, one marked
    block per turn in order; refused where the blocks and the turns do not pair up. `text`: the
    conversation as the template renders it."""
    if not getattr(tokenizer, "is_fast", False):
        raise ArgumentError(f"{where}: the chat template marks the assistant's text ({{% generation %}}), and "
                            "reading the marks needs a fast tokenizer (a folder with tokenizer.json)")
    out = render(tokenizer, messages, where, tokenize=True, return_dict=True, add_generation_prompt=False,
                 return_assistant_tokens_mask=True, **options)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    spans = _runs(mask)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if len(spans) != len(turns):
        raise ArgumentError(f"{where}: the chat template marks {len(spans)} stretch{'es' * (len(spans) != 1)} of "
                            f"the assistant's text ({{% generation %}}) in a conversation of {len(turns)} assistant "
                            f"turn{'s' * (len(turns) != 1)}; each assistant turn must be marked once (a template "
                            "that marks the last turn alone trains the last answer only: use mask_history: true "
                            "with one that marks every turn)")
    offsets = out.encodings[0].offsets
    for (start, end), k in zip(spans, turns):
        held = text[offsets[start][0]:offsets[end - 1][1]]
        looks = [t.rsplit("</think>", 1)[-1].strip() for t in texts(messages[k].get("content"))]
        if not all(t in held for t in looks):
            raise ArgumentError(f"{where}: the chat template's mark for assistant turn {k} ({{% generation %}}) does "
                                "not hold the turn's text; the marks must enclose what the assistant writes")
    return ids, spans


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, on in enumerate(mask + [0]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            spans.append((start, i))
            start = None
    return spans
