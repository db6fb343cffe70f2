"""A planned step's images: the meta inputs a vision-language model's processor would write for
`images_per_row` images of `image_size` pixels in every row.

Images are part of the input signature: pixel_values' shape (how many images the tower encodes,
at what resolution) fixes the tower's work and the number of image tokens the ids hold. Each
family's processor decides both, and the batch built here follows it:

- LLaVA and Gemma 3: the processor resizes every image to the vision tower's square
  (`vision_config.image_size`), whatever its size; pixel_values are [images, 3, S, S], and each
  image fills as many image tokens as the tower and projector give features for one image (read
  from the model itself, on the meta device). Gemma 3's pan-and-scan crops (off by default) are
  not planned.
- Idefics3 / SmolVLM: the processor resizes an image's longest edge to `size["longest_edge"]`
  (here: `image_size`) and splits it into tiles of the tower's size, plus the whole image resized
  to one tile when it splits (the image processor's own `get_number_of_image_patches`);
  pixel_values are [rows, tiles per row, 3, T, T] and each tile fills
  (T / patch)^2 / scale_factor^2 image tokens.
- Qwen2.5-VL, Qwen3-VL and Qwen3.5: the processor keeps an image's shape, resized to multiples of patch x merge pixels
  within its pixel budget (the image processor's own resizing, run on a blank image of that
  size), and flattens it into patches: pixel_values are [patches of every image, C x T x P x P],
  image_grid_thw each image's (frames, rows, columns) of patches, and each image fills
  patches / merge^2 image tokens. The grids are values (constants of the capture), so they are
  real here; the 3D positions the engine computes before a step are a meta input of [3, rows,
  seq].

Other vision-language families are refused by name: capture does not train them with images
(docs/families.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import arguments
from ..errors import ArgumentError

# model_type -> how its processor lays images out: one tower-sized image per image, or tiles
# padded per row.
FAMILIES = {"llava": "resized", "gemma3": "resized", "idefics3": "tiled", "smolvlm": "tiled", "qwen2_vl": "grid",
            "qwen2_5_vl": "grid", "qwen3_vl": "grid", "qwen3_vl_moe": "grid", "qwen3_5": "grid", "qwen3_5_moe": "grid"}
NAMES = ("LLaVA (llava), Gemma 3 (gemma3), Idefics3 (idefics3), SmolVLM (smolvlm), Qwen2-VL (qwen2_vl), "
         "Qwen2.5-VL (qwen2_5_vl), Qwen3-VL (qwen3_vl, qwen3_vl_moe) and Qwen3.5 (qwen3_5, qwen3_5_moe)")


@dataclass(frozen=True)
class ImageSignature:
    """The images of one planned step."""
    family: str                 # the config's model_type
    images_per_row: int
    image_size: int             # pixels per side of each image handed to the processor
    pixels: int                 # pixels per side of what the tower encodes (the tower's size)
    tiles_per_image: int        # tower inputs per image: 1, or the tiles and the whole image
    tokens_per_image: int       # image tokens one image fills in the ids

    @property
    def tokens_per_row(self) -> int:
        return self.images_per_row * self.tokens_per_image

    def describe(self) -> str:
        tiles = (f", {self.tiles_per_image} tiles of {self.pixels} px each (the image processor's split)"
                 if self.tiles_per_image > 1 else
                 f", resized to the tower's {self.pixels} x {self.pixels} px" if self.pixels != self.image_size else "")
        return (f"{self.images_per_row} per row of {self.image_size} x {self.image_size} px{tiles}: "
                f"{self.tokens_per_image:,} image tokens each, {self.tokens_per_row:,} of each row's tokens")

    def to_json(self) -> dict:
        return {"family": self.family, "images_per_row": self.images_per_row, "image_size": self.image_size,
                "pixels": self.pixels, "tiles_per_image": self.tiles_per_image,
                "tokens_per_image": self.tokens_per_image}


def sized_by_area(model: nn.Module) -> bool:
    """Whether the model's processor keeps each image's size, its tokens following the image's area
    (Qwen's grids), rather than resizing or tiling it by its sides."""
    return FAMILIES[family_of(model)] == "grid"


def family_of(model: nn.Module) -> str:
    """The model's vision-language family, or an ArgumentError naming why it cannot plan images."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if getattr(config, "vision_config", None) is None:
        raise ArgumentError(f"images_per_row plans images, but the model ({type(model).__name__}, model_type "
                            f"{model_type!r}) has no vision tower: plan it without images")
    if model_type not in FAMILIES:
        raise ArgumentError(f"planning with images covers {NAMES}; {type(model).__name__} (model_type "
                            f"{model_type!r}) places its image features its own way and is not trained with images "
                            "yet (docs/families.md): plan its text path without images_per_row")
    return model_type


def image_inputs(model: nn.Module, batch: int, seq: int, images_per_row: int,
                 image_size: int | None) -> tuple[dict[str, torch.Tensor], ImageSignature]:
    """The meta batch (input_ids, labels and the family's image inputs) of `batch` rows of `seq`
    tokens, each holding `images_per_row` images of `image_size` pixels (default: the tower's)."""
    images_per_row = arguments.count("images_per_row", images_per_row, what=" (images in each row of the batch)")
    family = family_of(model)
    config = model.config
    if FAMILIES[family] == "grid":
        return _grid_inputs(model, batch, seq, images_per_row, image_size)
    tower = int(config.vision_config.image_size)
    image_size = tower if image_size is None else arguments.count(
        "image_size", image_size, what=" (pixels per side of each image)")
    if FAMILIES[family] == "resized":
        tiles, tokens = 1, _features_per_image(model, tower)
    else:
        tiles = _tiles(family, image_size, tower)
        patches = (tower // int(config.vision_config.patch_size)) ** 2
        tokens = tiles * (patches // int(config.scale_factor) ** 2)
    signature = _fits(ImageSignature(family, images_per_row, image_size, tower, tiles, tokens), seq)
    meta = dict(device="meta")
    ids = torch.empty(batch, seq, dtype=torch.long, **meta)
    inputs = {"input_ids": ids, "labels": ids}
    if FAMILIES[family] == "resized":
        inputs["pixel_values"] = torch.empty(batch * images_per_row, 3, tower, tower, **meta)
        if family == "gemma3":
            inputs["token_type_ids"] = torch.empty(batch, seq, dtype=torch.long, **meta)
    else:
        per_row = images_per_row * tiles
        inputs["pixel_values"] = torch.empty(batch, per_row, 3, tower, tower, **meta)
        inputs["pixel_attention_mask"] = torch.empty(batch, per_row, tower, tower, dtype=torch.bool, **meta)
    return inputs, signature


def folder_pixels(config) -> dict:
    """The pixel range of the image processor in the folder a config was read from (its
    preprocessor_config.json: `size` {shortest_edge, longest_edge}, or min_pixels and max_pixels), as
    Qwen2VLImageProcessor's `size`; {} where there is none (the processor's defaults, Qwen2-VL's)."""
    import json
    import os
    folder = getattr(config, "_name_or_path", None)
    path = os.path.join(folder, "preprocessor_config.json") if isinstance(folder, str) and folder else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return {}
    size = saved.get("size") if isinstance(saved.get("size"), dict) else {}
    low = size.get("shortest_edge", saved.get("min_pixels"))
    high = size.get("longest_edge", saved.get("max_pixels"))
    if not (isinstance(low, int) and isinstance(high, int)):
        return {}
    return {"size": {"shortest_edge": low, "longest_edge": high}}


def _features_per_image(model: nn.Module, pixels: int) -> int:
    """Image tokens one image fills: the features the model's own tower and projector give it
    (on the meta device no weight is read; a model with weights encodes one blank image)."""
    inner = getattr(model, "model", model)
    param = next(model.parameters())
    image = torch.zeros(1, 3, pixels, pixels, device=param.device, dtype=param.dtype)
    with torch.no_grad():
        out = inner.get_image_features(pixel_values=image)
    features = getattr(out, "pooler_output", out)
    if isinstance(features, (list, tuple)):
        features = features[0]
    return features.numel() // features.shape[-1]


def _tiles(family: str, image_size: int, tower: int) -> int:
    """Tower inputs one square image of `image_size` pixels gives, by the family's image processor."""
    from transformers import Idefics3ImageProcessorPil, SmolVLMImageProcessorPil
    processor = Idefics3ImageProcessorPil() if family == "idefics3" else SmolVLMImageProcessorPil()
    kwargs = {"size": {"longest_edge": image_size}, "max_image_size": {"longest_edge": tower}}
    tiles = processor.get_number_of_image_patches(image_size, image_size, kwargs)[0]
    return max(tiles, 1)    # 0: no split, the image is one tile


def _fits(signature: ImageSignature, seq: int) -> ImageSignature:
    if signature.tokens_per_row >= seq:
        raise ArgumentError(f"seq {seq} cannot hold {signature.images_per_row} image(s) of "
                            f"{signature.tokens_per_image:,} image tokens each ({signature.family}, "
                            f"{signature.image_size} px): give seq above {signature.tokens_per_row:,}, or fewer or "
                            "smaller images")
    return signature


def _grid_processor(model: nn.Module):
    """The image processor Qwen's grids are planned with: the PIL class at the tower's patch, merge and
    frames, within the folder's pixel range."""
    from transformers import Qwen2VLImageProcessorPil
    vision = model.config.vision_config
    return Qwen2VLImageProcessorPil(patch_size=int(vision.patch_size), merge_size=int(vision.spatial_merge_size),
                                    temporal_patch_size=int(vision.temporal_patch_size), **folder_pixels(model.config))


def grid_tokens(model: nn.Module):
    """(width, height) -> the image tokens a Qwen image of that size fills, as the processor the plan
    uses resizes it (multiples of patch x merge within its pixel range); None for a family whose
    images are not sized by their area (sized_by_area)."""
    if not sized_by_area(model):
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    processor = _grid_processor(model)
    patch, merge = processor.patch_size, processor.merge_size

    def tokens(width: int, height: int) -> int:
        h, w = smart_resize(height, width, factor=patch * merge, min_pixels=processor.size["shortest_edge"],
                            max_pixels=processor.size["longest_edge"])
        return (h // patch) * (w // patch) // merge ** 2
    return tokens


def _grid_inputs(model: nn.Module, batch: int, seq: int, images_per_row: int,
                 image_size: int | None) -> tuple[dict[str, torch.Tensor], ImageSignature]:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's images: flattened patches, each image's grid, its token types and 3D
    positions."""
    if image_size is None:
        raise ArgumentError(f"{type(model).__name__} keeps each image's size (its processor resizes it to "
                            "multiples of the patch within a pixel budget), so planning its images needs image_size: "
                            "the pixels per side of each image, e.g. image_size=448 (--image-size 448)")
    image_size = arguments.count("image_size", image_size, what=" (pixels per side of each image)")
    vision = model.config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    import numpy as np
    processor = _grid_processor(model)
    written = processor([np.zeros((image_size, image_size, 3), dtype=np.uint8)], return_tensors="pt")
    grid = [int(v) for v in written["image_grid_thw"][0]]
    patches = grid[0] * grid[1] * grid[2]
    signature = _fits(ImageSignature(model.config.model_type, images_per_row, image_size, grid[1] * patch, 1,
                                     patches // merge ** 2), seq)
    images, meta = batch * images_per_row, dict(device="meta")
    ids = torch.empty(batch, seq, dtype=torch.long, **meta)
    return {"input_ids": ids, "labels": ids,
            "pixel_values": torch.empty(images * patches, written["pixel_values"].shape[-1], **meta),
            "mm_token_type_ids": torch.empty(batch, seq, dtype=torch.int32, **meta),
            "position_ids": torch.empty(3, batch, seq, dtype=torch.long, **meta),
            "image_grid_thw": torch.tensor([grid] * images)}, signature
