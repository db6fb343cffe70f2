"""Preference pairs with images (stage dpo on a vision-language model): LlamaFactory's sharegpt
ranking layout with an `images` (`videos`) column, as its rlhf_v dataset is written,

    {"conversations": [{"from": "human", "value": "<image>what is in the picture"}],
     "chosen": {"from": "gpt", "value": "a red square"},
     "rejected": {"from": "gpt", "value": "a blue circle"},
     "images": ["images/red.png"]}

or TRL's {prompt, chosen, rejected} as lists of messages (text with `<image>` placeholders, or
content parts {"type": "image"}), with `images` (`image`).

Each side is the conversation prompt + answer written as a supervised record with the same images
is written (encoding.py: the chat template, then the processor, which widens each image to its
tokens), its last answer alone the target. The pair's prompt is the tokens before the answer's
first target, which both sides must share, image tokens included; its completions the tokens from
there on, as posttrain/preference.py's text pairs are laid out. The images go with the pair
(Pair.media) and are read when a micro-batch is packed: the chosen rows and the rejected rows each
hold the prompt's images.
"""
from __future__ import annotations

from ...errors import ArgumentError
from ...posttrain import Pair
from . import encoding
from .ranking import preference

# what a record's media columns and its template's arguments are called; carried to each side
CARRIED = ("images", "image", "videos", "tools", "chat_template_kwargs")


def image_pair(record: dict, where: str, tokenizer, media) -> Pair:
    """The pair of a preference record with images, tokenised through `media` (images.Media)."""
    ranked = preference(record, where)
    prompt = ranked.get("prompt")
    if not isinstance(prompt, list):
        raise ArgumentError(f"{where}: a preference record with images gives its prompt as a conversation (ShareGPT's "
                            "conversations, or TRL's prompt as a list of messages) whose turns hold an <image> "
                            "placeholder per image; the prompt here is " + ("text" if isinstance(prompt, str)
                                                                            else "missing"))
    sides = []
    for k in ("chosen", "rejected"):
        answer = ranked.get(k)
        if not (isinstance(answer, list) and len(answer) == 1 and isinstance(answer[0], dict)
                and answer[0].get("role") == "assistant"):
            raise ArgumentError(f"{where}: with images, {k} is the model's one answer to the prompt (a single "
                                f"assistant turn: {{from: gpt, value}} or [{{role: assistant, content}}]); got "
                                f"{str(answer)[:200]}")
        side = {"messages": prompt + answer, **{c: record[c] for c in CARRIED if c in record}}
        made = encoding.document(tokenizer, side, False, f"{where} ({k})", media, mask_history=True)
        if not any(made.targets):
            raise ArgumentError(f"{where}: {k} has no tokens after the prompt's; give the {k} answer's text")
        first = made.targets.index(True)
        sides.append((made.ids[:first], made.ids[first:]))
    (prompt_c, chosen), (prompt_r, rejected) = sides
    if prompt_c != prompt_r:
        raise ArgumentError(f"{where}: the chat template writes the prompt otherwise before chosen than before "
                            "rejected, so the two do not score completions of one prompt; give answers the template "
                            "writes after the same prompt")
    if chosen == rejected:
        raise ArgumentError(f"{where}: chosen and rejected are the same answer (their tokens are equal), which "
                            "prefers nothing: leave the record out, or give it two different answers")
    return Pair(tuple(prompt_c), tuple(chosen), tuple(rejected), tuple(media.paths(record, where)))
