"""`megacompile plan --run` on a vision-language run: the images its rows hold at their heaviest, read
from its data as the run reads it, so that the plan before the run is made with images, not of the
text alone.

A row holds one record's images (documents with images fill rows of their own under stage sft;
under dpo, kto, grpo and rm each row holds its prompt's), so the plan's `images_per_row` is the most
images a record of the run's data shows, and its `image_size` the largest image as the run reads it
(scaled within image_max_pixels and image_min_pixels, pixels.py): for a family whose processor keeps
each image's size (Qwen's grids) the side of a square of its pixels, which fills the tokens it
fills; for the others its longest side (their processors resize or tile by it). The most images and
the largest image may come from different records: the plan is of a row at least as heavy as any
the run meets. Only each image's header is read. Videos are not planned (the planner's rows hold
images), and said so. The command's --images-per-row and --image-size, where given, are planned in
their place.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

from ..errors import ArgumentError
from ..planner import image_inputs, sized_by_area
from . import beside
from .config import RunConfig
from .data import grid_images, images, pixels
from .data.reading import records
from .data.tokens import load_tokenizer

STAGES = ("sft", "dpo", "kto", "grpo", "rm")      # the stages that train records with images


@dataclass(frozen=True)
class RunImages:
    per_row: int            # the most images a record shows
    size: int               # the planned image side, pixels
    largest: tuple[int, int]    # the largest image as the run reads it (width, height)
    shown: int              # records with images
    videos: int             # records with videos (not planned)

    def describe(self) -> str:
        videos = (f"; {self.videos} record(s) with videos, which the plan leaves out" if self.videos else "")
        return (f"  images         from the run's data: {self.shown:,} record(s) with images, at most {self.per_row} "
                f"in one, the largest {self.largest[0]} x {self.largest[1]} px as the run reads it: planned as "
                f"{self.per_row} per row of {self.size} x {self.size} px (--images-per-row and --image-size plan "
                f"others){videos}")


def heaviest(c: RunConfig, model) -> RunImages | None:
    """The run's images at their heaviest, or None where its model has no processor, its stage
    trains text alone, or its data shows no image."""
    folder = c.tokenizer or c.model
    if c.stage not in STAGES or not images.has_processor(folder):
        return None
    media = grid_images.for_run(c, load_tokenizer(folder, c.chat_template, None, c.model), folder)
    limits = pixels.limits(c)
    most, shown, videos, largest = 0, 0, 0, None
    with tempfile.TemporaryDirectory(prefix="megacompile-plan-") as kept:
        media.keep_embedded_in(kept)        # images a table holds, written there to read their size
        for entry in c.data:
            media.at(entry["path"], entry.get("media_dir"))
            for where, record in records(entry):
                if not images.held(record):
                    continue
                found = media.paths(record, where)
                files = images.images_of(found)
                videos += len(files) < len(found)
                if not files:
                    continue
                shown, most = shown + 1, max(most, len(files))
                for path in files:
                    size = _read_size(path, where, limits)
                    if largest is None or _weight(size, model) > _weight(largest, model):
                        largest = size
    if largest is None:
        return None
    return RunImages(most, _side(largest, model), largest, shown, videos)


def held_beside(c: RunConfig, model, per_row: int, size: int | None, rows: int) -> list[beside.Beside]:
    """What the run holds in host memory beside the engine's state for its images, as its stage
    counts it (Stage.host_beside), at the planned row (`per_row` images of `size` px): the pixels
    kept for images read again, and a micro-batch of `rows` such rows' pixel inputs. Stage grpo's
    rollout pixels are not here."""
    inputs, signature = image_inputs(model, rows, c.seq, per_row, size)
    return beside.kept_pixels() + beside.pixel_inputs(
        inputs, f"a micro-batch's pixel inputs, {rows} rows of {per_row} images of {signature.image_size} px")


def _read_size(path: str, where: str, limits: pixels.Limits) -> tuple[int, int]:
    """The image's width and height as the run reads it (within the pixel limits), from its header."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            width, height = image.size
    except Exception as e:  # noqa: BLE001 - PIL's own words, with the file named
        said = str(e).splitlines()[0][:200]
        raise ArgumentError(f"{where}: cannot read image {os.path.basename(path)}: {said}") from e
    return pixels.fitted_size(width, height, limits)


def _weight(size: tuple[int, int], model) -> int:
    return size[0] * size[1] if sized_by_area(model) else max(size)


def _side(size: tuple[int, int], model) -> int:
    return math.ceil(math.sqrt(size[0] * size[1])) if sized_by_area(model) else max(size)
