"""The images stage grpo's prompts show (a vision-language model: data/image_prompts.py), beside
their tokens: what a batch of rows over them carries (the processor's image inputs, made when the
rows are batched), the rows that stand for the heaviest of them when a run chooses its budget, the
pixels a generation copy's tower passes over, and the tokens no completion may hold.

`shown[i]` is prompt i's images (paths; () for a text prompt); `media` the run's processor
(data/images.py's Media), None for a text model."""
from __future__ import annotations

import torch

from ..data.image_answers import heaviest


def inputs(media, shown: list[tuple], input_ids: torch.Tensor) -> dict:
    """The image inputs of rows showing `shown` (each row's images), as the processor batches them;
    none where no row shows one."""
    if media is None or not any(shown):
        return {}
    return media.inputs([list(m) for m in shown], input_ids)


def showing(media, rows: dict, prompts: list[list[int]], shown: list[tuple], pad: int) -> dict:
    """`rows` (a batch for its shapes: input_ids first) with these prompts' tokens at the start of
    its rows and the image inputs of their images, where any shows one (a plan per grid of images)."""
    if not any(shown):
        return rows
    ids = torch.full_like(rows["input_ids"], pad)
    for r, prompt in enumerate(prompts):
        ids[r, :len(prompt)] = torch.tensor(prompt)
    return {**rows, "input_ids": ids, **inputs(media, shown, ids)}


def heaviest_prompts(media, shown: list[tuple], rows: int, each: int = 1) -> list[int] | None:
    """`rows` rows of the prompts whose images fill the most tokens, a prompt in at most `each` of
    them (the rows of its completions), repeated where fewer; None without images."""
    return heaviest(shown, media, rows, each)


def rollout_pixels(media, shown: list[tuple], rows: int, each: int = 1) -> tuple[int, int] | None:
    """A rollout batch's pixel values at their heaviest (its `rows` rows those of the prompts whose
    images fill the most tokens, a prompt in at most `each`) and its largest image's, as elements;
    None without images."""
    items = heaviest(shown, media, rows, each)
    if items is None:
        return None
    each = [media.pixel_elements(m) for i in items for m in shown[i]]
    return sum(each), max(each)


def never(media) -> tuple[int, ...]:
    """The image and video tokens: a completion holding one would ask the model for an image it was
    not shown, in every forward of its row."""
    return tuple(media.image_ids) + tuple(t for t in (getattr(media, "video_id", None),) if t is not None)


def handed(records: list[dict], shown: list[tuple]) -> list[dict]:
    """The records as the reward functions are handed them: their `image` and images columns the
    pictures their prompts show (PIL images, as a datasets Image column decodes them and TRL hands
    them on), `image` the first, the images column (`images`, or the file's name for it where
    dataset_info.json renames it: data/prompts.PromptRecord) all. Each picture is read once for the
    call and let go after it: nothing is kept beside the run's planned host memory."""
    opened: dict[str, object] = {}

    def read(path: str):
        if path not in opened:
            opened[path] = picture(path)
        return opened[path]
    return [_handed(r, s, read) for r, s in zip(records, shown)]


def _handed(record: dict, shown: tuple, read) -> dict:
    many = getattr(record, "images_column", "images")
    if not shown or not {"image", many} & set(record):
        return record
    pictures = [read(p) for p in shown if isinstance(p, str)]
    out = dict(record)
    if "image" in out:
        out["image"] = pictures[0]
    if many in out:
        out[many] = pictures
    return out


def picture(path: str):
    """The image file as a PIL image, read whole (a datasets Image column's decoding)."""
    from PIL import Image
    with Image.open(path) as image:
        image.load()
        return image.copy()
