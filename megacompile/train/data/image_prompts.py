"""GRPO's prompts with images (stage grpo on a vision-language model), as TRL's GRPOTrainer reads a
vision dataset: the prompt a conversation whose turns hold an image part (or an `<image>`
placeholder) per image, its images in the record's `image` (one) or `images` column,

    {"prompt": [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What colour is this?"}]}],
     "image": "images/red.png", "solution": "red"}

(a conversation of strings that marks none of its images gets them first in its first user turn,
as TRL's prepare_multimodal_messages lays it out: parts.py). The prompt is written as TRL writes
it: the chat template with the generation prompt, then the processor with the images, each image
widened to its tokens (images.py; Qwen2.5-VL's grids: grid_images.py). It is never cut: a prompt
with images longer than max_prompt_length is refused, as cutting it could split an image's tokens.
"""
from __future__ import annotations

from ...errors import ArgumentError
from ...posttrain import check_texts, render
from . import list_contents, parts, sharegpt, tools


def image_prompt(record: dict, prompt, where: str, tokenizer, media, longest: int) -> tuple[list[int], tuple]:
    """The tokens of `prompt` (data/prompts.py's prompt_record's), its images widened, and its media
    (paths), of a grpo record with images, as read (its columns, the template's arguments);
    `longest`: max_prompt_length."""
    if not isinstance(prompt, list):
        raise ArgumentError(f"{where}: a prompt with images is a conversation (TRL's prompt as a list of messages, "
                            "or LlamaFactory's conversations) whose turns hold an image part or an <image> "
                            "placeholder per image; the prompt here is text")
    paths = media.paths(record, where)
    messages = media.messages(parts.read(sharegpt.messages({"messages": prompt}, where), True, where), paths, where,
                              list_contents.reads_lists_only(tokenizer))
    listed, options = tools.tools(record, where), tools.template_kwargs(record, where)
    options = {**options, **({"tools": listed} if listed else {})}
    text = render(tokenizer, messages, where, "prompt", tokenize=False, add_generation_prompt=True, **options)
    check_texts(text, messages, where)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, _ = media.widen(ids, [False] * len(ids), paths, where, tokenizer, messages, options, generation_prompt=True)
    if len(ids) > longest:
        raise ArgumentError(f"{where}: the prompt is {len(ids)} tokens with its images, past max_prompt_length "
                            f"{longest}, and a prompt with images is not cut (its image tokens would be split): "
                            "raise max_prompt_length, or scale the images down (image_max_pixels)")
    return ids, tuple(paths)
