"""Post-training records with images (stages dpo and kto on a vision-language model): a prompt
that shows images, and the model's answers to it. For stage dpo, LlamaFactory's sharegpt ranking
layout with an `images` (`videos`) column, as its rlhf_v dataset is written,

    {"conversations": [{"from": "human", "value": "<image>what is in the picture"}],
     "chosen": {"from": "gpt", "value": "a red square"},
     "rejected": {"from": "gpt", "value": "a blue circle"},
     "images": ["images/red.png"]}

or TRL's {prompt, chosen, rejected} as lists of messages (text with `<image>` placeholders, or
content parts {"type": "image"}), with `images` (`image`); for stage kto, its feedback layouts
(data/feedback.py) likewise, a conversation ending with the answer its kto_tag judges.

Each answer is written with its prompt as a supervised record of that conversation and the same
images is written (encoding.py: the chat template, then the processor, which widens each image
to its tokens), its last answer alone the target. The prompt is the tokens before the answer's
first target, which every answer must share, image tokens included; an answer's completion the
tokens from there on, as posttrain/preference.py's text pairs are laid out. The images go with the
pair or example (their `media`, paths) and are read when a micro-batch is packed (with_media):
every row holds its prompt's images.
"""
from __future__ import annotations

import os

from ...errors import ArgumentError
from ...posttrain import Pair
from . import encoding
from .ranking import preference

# what a record's media columns and its template's arguments are called; carried to each answer
CARRIED = ("images", "image", "videos", "tools", "chat_template_kwargs")


def image_pair(record: dict, where: str, tokenizer, media) -> Pair:
    """The pair of a preference record with images, tokenised through `media` (images.Media)."""
    ranked = preference(record, where)
    prompt, (chosen, rejected) = answered(record, ranked.get("prompt"), {k: ranked.get(k) for k in
                                                                         ("chosen", "rejected")},
                                          where, tokenizer, media)
    if chosen == rejected:
        raise ArgumentError(f"{where}: chosen and rejected are the same answer (their tokens are equal), which "
                            "prefers nothing: leave the record out, or give it two different answers")
    return Pair(prompt, chosen, rejected, tuple(media.paths(record, where)))


def answered(record: dict, prompt, answers: dict, where: str, tokenizer, media) -> tuple[tuple, list[tuple]]:
    """The prompt's tokens, its images widened, and each answer's completion tokens ({name: one
    assistant turn}), of a record with images."""
    if not isinstance(prompt, list):
        raise ArgumentError(f"{where}: a record with images gives its prompt as a conversation (ShareGPT's "
                            "conversations, or TRL's prompt as a list of messages) whose turns hold an <image> "
                            "placeholder per image; the prompt here is " + ("text" if isinstance(prompt, str)
                                                                            else "missing"))
    prompts, completions = [], []
    for k, answer in answers.items():
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
        prompts.append(tuple(made.ids[:first]))
        completions.append(tuple(made.ids[first:]))
    if len(set(prompts)) > 1:
        raise ArgumentError(f"{where}: the chat template writes the prompt otherwise before "
                            f"{' than before '.join(answers)}, so they do not answer one prompt; give answers the "
                            "template writes after the same prompt")
    return prompts[0], completions


def with_media(rows: dict, media, shown: list[tuple]) -> dict:
    """`rows` (input_ids, labels) with the image inputs of their images, `shown[r]` row r's (as the
    processor writes them for a batch: data/images.py), where any row holds one."""
    if media is not None and any(shown):
        rows.update(media.inputs([list(m) for m in shown], rows["input_ids"]))
    return rows


def media_digest(shown: tuple) -> tuple[int, ...]:
    """An item's images and videos (paths) as numbers a reference digest reads: each path with its
    file's size and time, so that a reference kept for a resume is refused for images changed in
    place, as the data files' own are (tokens.fingerprint)."""
    found = []
    for item in shown:
        path = item["video"] if isinstance(item, dict) else item
        stat = os.stat(path)
        found.append((path, stat.st_size, stat.st_mtime_ns))
    return tuple(repr(found).encode())


def heaviest(shown: list[tuple], media, batch: int, each: int = 1) -> list[int] | None:
    """The `batch` items (each showing `shown[i]`) whose images fill the most tokens, in order, an
    item at most `each` times (a grpo rollout's rows repeat each prompt: its completions), one
    repeated where there are fewer; None where none shows an image."""
    if media is None or not any(shown):
        return None
    width = getattr(media, "width", lambda path, where: 1)     # Qwen's grids; else one per image
    load = [sum(width(m, str(m)) for m in items) for items in shown]
    ranked = sorted(range(len(load)), key=lambda i: -load[i])
    chosen = sorted([i for i in ranked for _ in range(each)][:batch])
    return [chosen[k % len(chosen)] for k in range(batch)]
