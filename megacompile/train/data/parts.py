"""A turn's content as a list of parts, as TRL's and transformers' vision-language records write it:

    {"messages": [{"role": "user", "content": [{"type": "image"},
                                               {"type": "text", "text": "What is in the picture?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}],
     "images": ["images/0001.png"]}

Each image (video) part stands for the next file of the record's `images` (`videos`), in order,
as an `<image>` placeholder does in a string (images.py). For a vision-language model the parts go
to the chat template as they are: a processor's template reads them natively (LLaVA's reads
nothing else), and writes each image as the processor's image token, which images.py counts. A
text model's template takes strings: a turn of text parts alone is read as their texts joined,
as the vision templates join them (nothing between). A conversation of strings whose record has
images and marks none of them (no placeholder, no image part) is laid out as TRL's
prepare_multimodal_messages lays it out: every turn made parts, the images first in the first
user turn.
"""
from __future__ import annotations

from typing import Any

from ...errors import ArgumentError
from ...posttrain import texts

KINDS = ("text", "image", "video")


def is_parts(content: Any) -> bool:
    return isinstance(content, list)


def check(content: list, where: str, turn: int) -> None:
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in KINDS:
            raise ArgumentError(f"{where}: turn {turn}'s content parts are {{type: text, text: ...}}, {{type: image}} "
                                f"or {{type: video}}; got {str(part)[:120]}")
        if kind == "text" and not isinstance(part.get("text"), str):
            raise ArgumentError(f"{where}: turn {turn} has a text part without its text (a string): {str(part)[:120]}")
        inline = [k for k in ("image", "url", "path", "video") if kind != "text" and k in part]
        if inline:
            raise ArgumentError(f"{where}: turn {turn} names its {kind} inside the part ({inline[0]}); give the "
                                f"files as the record's {kind}s list, in order, and the parts as {{type: {kind}}}")


def count(content: list, kind: str) -> int:
    return sum(p.get("type") == kind for p in content)


def read(messages: Any, vision: bool, where: str) -> Any:
    """The turns, their parts checked; for a text model (`vision` False) each list of parts made
    into its text. A malformed conversation is returned as it is, for masking.chat to refuse."""
    if not isinstance(messages, list):
        return messages
    out = []
    for k, m in enumerate(messages):
        if isinstance(m, dict) and is_parts(m.get("content")):
            check(m["content"], where, k)
            if not vision:
                media = [p["type"] for p in m["content"] if p["type"] != "text"]
                if media:
                    raise ArgumentError(f"{where}: turn {k} holds {media[0]} parts, which are read only with a "
                                        "vision-language model's processor; give such a model, or text parts alone")
                m = {**m, "content": "".join(texts(m["content"]))}
        out.append(m)
    return out


def images_first(messages: list, images: int, placeholder: str, where: str) -> list:
    """TRL's layout of a conversation that marks none of its `images`; one that marks any, or
    has none, as it is (the count is checked where the placeholders are read)."""
    if not images or not all(isinstance(m, dict) for m in messages):
        return messages
    contents = [m.get("content") for m in messages]
    if any(placeholder in c if isinstance(c, str) else is_parts(c) for c in contents):
        return messages
    if not all(isinstance(c, str) for c in contents):
        return messages         # masking.chat refuses it with the line
    users = [k for k, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ArgumentError(f"{where}: the record has images, no {placeholder} placeholder marks where they go, and "
                            "no user turn to put them in (TRL puts them first in the first one); mark them")
    return [{**m, "content": [{"type": "image"}] * (images if k == users[0] else 0)
             + ([{"type": "text", "text": m["content"]}] if m["content"] else [])}
            for k, m in enumerate(messages)]
