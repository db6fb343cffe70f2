"""LlamaFactory's image_max_pixels and image_min_pixels: each image of a record scaled, keeping its
aspect ratio, so that width x height is at most image_max_pixels (then at least image_min_pixels),
before the model's processor sees it, as LlamaFactory's `_preprocess_image` does.

That is all a fixed-size processor needs (LLaVA's CLIP, Gemma 3's SigLIP, Idefics3's resize the
scaled image to their own size again, so only the detail it keeps changes). A processor that keeps
each image's size (Qwen2-VL's family: its `size` {shortest_edge, longest_edge} are the fewest and
most pixels, and it rounds each side to whole merged patches) is bounded by the same limits too,
so that its rounding cannot take an image past image_max_pixels: such an image fills at most
image_max_pixels / (patch_size * merge_size)**2 tokens.

    limits(c)             the run's Limits (RunConfig's image_max_pixels, image_min_pixels)
    fit(image, limits)    the PIL image scaled within them (the image itself when within)
    fitted_size(w, h, limits)  the size fit gives, read from no pixels
    attach(media, limits) a data/images.Media (or GridMedia) set to read its images within them
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    max_pixels: int | None = None
    min_pixels: int | None = None

    @property
    def given(self) -> bool:
        return self.max_pixels is not None or self.min_pixels is not None


NONE = Limits()


def limits(c: Any) -> Limits:
    """The run's limits (config.py checked them: whole numbers >= 1, min <= max)."""
    return Limits(getattr(c, "image_max_pixels", None), getattr(c, "image_min_pixels", None))


def fit(image, within: Limits = NONE):
    """`image` (PIL) scaled by one factor on both sides so that width * height <= max_pixels, then
    >= min_pixels: LlamaFactory's rule (it rounds the sides down; here a side is at least 1
    pixel, and scaling up rounds up, so the image does reach min_pixels)."""
    down = _down(*image.size, within)
    if down != image.size:
        image = image.resize(down)
    up = _up(*image.size, within)
    return image if up == image.size else image.resize(up)


def fitted_size(width: int, height: int, within: Limits = NONE) -> tuple[int, int]:
    """The (width, height) fit() gives an image of this size, without reading its pixels."""
    return _up(*_down(width, height, within), within)


def _down(width: int, height: int, within: Limits) -> tuple[int, int]:
    if within.max_pixels is None or width * height <= within.max_pixels:
        return width, height
    factor = math.sqrt(within.max_pixels / (width * height))
    return max(1, int(width * factor)), max(1, int(height * factor))


def _up(width: int, height: int, within: Limits) -> tuple[int, int]:
    if within.min_pixels is None or width * height >= within.min_pixels:
        return width, height
    factor = math.sqrt(within.min_pixels / (width * height))
    return math.ceil(width * factor), math.ceil(height * factor)


def keeps_size(image_processor) -> bool:
    """An image processor that sizes each image within a pixel range (Qwen2-VL's family, which
    writes image_grid_thw), not to a fixed size."""
    size = getattr(image_processor, "size", None)
    names = getattr(image_processor, "model_input_names", None) or ()
    return ("image_grid_thw" in names and size is not None
            and all(_get(size, k) is not None for k in ("shortest_edge", "longest_edge")))


def bound(image_processor, within: Limits) -> None:
    """A processor that keeps each image's size (keeps_size) told the limits as its own range
    (narrowed, never widened: its own fewest and most pixels stay where they are tighter)."""
    if not within.given or not keeps_size(image_processor):
        return
    size = image_processor.size
    low, high = int(_get(size, "shortest_edge")), int(_get(size, "longest_edge"))
    if within.max_pixels is not None:
        high = min(high, within.max_pixels)
    if within.min_pixels is not None:
        low = max(low, within.min_pixels)
    image_processor.size = {**_items(size), "shortest_edge": min(low, high), "longest_edge": high}


def attach(media, within: Limits) -> None:
    """`media` (data/images.Media or GridMedia) reads its images within the limits: its `limits`
    (which its image loading applies with fit) and its image processor's range (bound). Before
    any image is read: widths and pixels are cached per path."""
    media.limits = within
    processor = getattr(media, "image_processor", None)
    if processor is None:
        processor = getattr(getattr(media, "processor", None), "image_processor", None)
    if processor is not None:
        bound(processor, within)


def _get(size, key: str):
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _items(size) -> dict:
    if isinstance(size, dict):
        return dict(size)
    return {k: v for k, v in vars(size).items() if v is not None} if hasattr(size, "__dict__") else {}
