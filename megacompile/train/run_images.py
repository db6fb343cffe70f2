"""`megacompile plan --run` on a vision-language run: the images its rows hold at their heaviest, read
from its data as the run reads it, so that the plan before the run is made with images, not of the
text alone.

A row holds one record's images (documents with images fill rows of their own under stage sft;
under dpo, kto, grpo and rm each row holds its prompt's), and the plan's rows hold images of one
size. For a family whose processor keeps each image's size (Qwen's grids: its tokens follow its
area), the plan's row is the heaviest record's: its images' count, each a square of the smallest
side whose tokens, that many times, are at least the record's (each image as the run reads it,
scaled within image_max_pixels and image_min_pixels, pixels.py, then resized as the processor
resizes it). For the others the plan's `images_per_row` is the most images a record shows and its
`image_size` the largest image's longest side (their processors resize or tile by it), which may
come from different records. Either way the plan is of a row at least as heavy as any the run
meets. Only each image's header is read. Videos are not planned (the planner's rows hold
images), and said so. The command's --images-per-row and --image-size, where given, are planned in
their place.
"""
from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

from ..errors import ArgumentError
from ..planner import grid_tokens, image_inputs, sized_by_area
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
    most: int = 0           # the most images a record shows
    tokens: int | None = None   # the heaviest record's image tokens (Qwen's grids)

    def describe(self) -> str:
        videos = (f"; {self.videos} record(s) with videos, which the plan leaves out" if self.videos else "")
        heaviest = ("" if self.tokens is None else f", the heaviest {self.per_row} image(s) filling "
                    f"{self.tokens:,} tokens")
        return (f"  images         from the run's data: {self.shown:,} record(s) with images, at most "
                f"{self.most or self.per_row} in one, the largest {self.largest[0]} x {self.largest[1]} px as the run "
                f"reads it{heaviest}: planned as {self.per_row} per row of {self.size} x {self.size} px "
                f"(--images-per-row and --image-size plan others){videos}")


def heaviest(c: RunConfig, model) -> RunImages | None:
    """The run's images at their heaviest, or None where its model has no processor, its stage
    trains text alone, or its data shows no image."""
    folder = c.tokenizer or c.model
    if c.stage not in STAGES or not images.has_processor(folder):
        return None
    media = grid_images.for_run(c, load_tokenizer(folder, c.chat_template, None, c.model), folder)
    limits = pixels.limits(c)
    tokens = grid_tokens(model)
    most, shown, videos, largest, heavy = 0, 0, 0, None, (0, 0)      # heavy: the heaviest record's tokens, images
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
                sizes = [_read_size(path, where, limits) for path in files]
                for size in sizes:
                    if largest is None or _weight(size, model) > _weight(largest, model):
                        largest = size
                if tokens is not None:
                    heavy = max(heavy, (sum(tokens(*size) for size in sizes), len(sizes)))
    if largest is None:
        return None
    if tokens is None:
        return RunImages(most, _side(largest, model), largest, shown, videos, most)
    filled, count = heavy
    return RunImages(count, _square(tokens, filled, count, largest), largest, shown, videos, most, filled)


def _square(tokens, filled: int, count: int, largest: tuple[int, int]) -> int:
    """The side of a square image whose tokens, `count` times, are the fewest at least `filled`: the
    largest side that fills them (the processor rounds sides to its patches), not above the side of
    a square of the largest image's pixels where a smaller side fills them. A thin image may fill
    more tokens than a square of its area (the processor rounds its short side up to a patch): the
    square then grows past that side until it fills them, or until the processor's largest image
    (image_max_pixels) holds no more."""
    top = _side_of_area(largest)
    side = max(1, math.isqrt(max(filled // count, 1)))
    while count * tokens(side, side) < filled:
        if side >= top and tokens(2 * side, 2 * side) <= tokens(side, side):
            break
        side += 1
    while side < top and tokens(side + 1, side + 1) == tokens(side, side):
        side += 1
    return side


def _side_of_area(size: tuple[int, int]) -> int:
    return math.ceil(math.sqrt(size[0] * size[1]))


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
    return _side_of_area(size) if sized_by_area(model) else max(size)
