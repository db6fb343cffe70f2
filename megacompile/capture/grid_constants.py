"""Image and video grids (Qwen2.5-VL's image_grid_thw, video_grid_thw) as constants of the capture, keyed like shapes.

Qwen2.5-VL's vision tower reads each image's or video's grid of patches (frames, rows, columns) in
Python: its rotary table (`get_vision_position_ids`), the lengths its attention splits by
(`cu_seqlens`, one per frame, read with `.tolist()` in every tower layer; Qwen2-VL's tower reads
these two alone, every layer attending over whole images), its window index and
window lengths, and the split of its features per image or video. None of that traces over a
tensor whose values are unknown. The grids are known before the step runs, though: they describe
the pixels' layout, as shapes do. So the capture takes them as constants: `GridTower` computes
those tables eagerly from the step's real grids with transformers' own helpers
(`transformers.vision_utils`), and hands them to the tower as the precomputed inputs it accepts; in
the graph they are constants, and the lengths the attention splits by are plain numbers. Images
and videos go through the same tower (`get_image_features`, `get_video_features`); a step with
both runs it once over the two (`GridTower.encode`, grid_media.py). The attention, which splits by
the lengths and calls the attention function per chunk, runs once per chunk length instead while
capturing (vision_chunks.py).

A capture is then valid for its grids only. `grid_key` puts the grids' values beside the inputs'
shapes in the keys captures are found by (the engine's, engine/prepared.py's), so a batch with other grids
is captured anew (or, with retrace=False, refused); and `GridConstants.check` refuses a step whose
grids differ from the captured ones before anything runs, so no step runs on stale constants.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ..errors import CaptureError, InputMismatchError
from .deepstack import splits_per_image

# The model classes whose vision tower reads its grid's values; the names of those inputs.
_FAMILIES = {("transformers.models.qwen2_vl.modeling_qwen2_vl", "Qwen2VLModel"),
             ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
             ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
             ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel"),
             ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5Model"),
             ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeModel")}
GRID_INPUTS = ("image_grid_thw", "video_grid_thw")


def keys_grids(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in _FAMILIES


def _grid(t: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(v) for v in row) for row in t.tolist())


def grid_key(kwargs: dict) -> tuple:
    """The grids' values among a call's keyword inputs, to key its capture by beside the shapes."""
    return tuple((name, _grid(t)) for name in GRID_INPUTS
                 if isinstance(t := kwargs.get(name), torch.Tensor) and t.device.type != "meta")


def describe_grids(kwargs: dict) -> str:
    """The grids of a call, in words ('' without any)."""
    return "".join(f", {name} {list(values)}" for name, values in grid_key(kwargs))


@dataclass(frozen=True)
class GridConstants:
    """The grids a capture computed its vision tables from; a step must give the same."""
    module: str                 # the model that reads them, in words
    input: int                  # which of the model's input tensors holds them
    name: str                   # that input's name
    values: tuple[tuple[int, ...], ...]

    def check(self, inputs: list[torch.Tensor]) -> None:
        given = _grid(inputs[self.input])
        if given != self.values:
            raise InputMismatchError(
                f"the step's {self.name} is {list(given)}, but this capture of {self.module} was made for "
                f"{list(self.values)}: the grids are constants of a capture, like shapes; compile with "
                "retrace=True (the default) to capture each new set of grids")


def _vision_tables(visual: nn.Module, grid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The grid-dependent tables the tower computes, from a real grid, on the host: its rotary
    positions and the lengths its attention splits by, and Qwen2.5-VL's windows, or Qwen3-VL's
    resampling of its learned position grid to each image's (Qwen2-VL's tower has neither)."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                           get_vision_position_ids, get_vision_window_index)
    config = visual.config
    tables = {"position_ids": get_vision_position_ids(grid, config.spatial_merge_size),
              "cu_seqlens": get_vision_cu_seqlens(grid)}
    if hasattr(visual, "num_grid_per_side"):      # Qwen3-VL, Qwen3.5
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=config.spatial_merge_size)
        return tables | {"interp_indices": indices, "interp_weights": weights}
    if getattr(visual, "window_size", None) is not None:     # Qwen2.5-VL
        window_index, cu_window_seqlens = get_vision_window_index(grid, config.spatial_merge_size,
                                                                  config.window_size, config.patch_size)
        return tables | {"window_index": window_index, "cu_window_seqlens": cu_window_seqlens}
    return tables


# The inputs each kind of media comes in, as the model's forward names them: its patches, its grids.
MEDIA = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}


def patch_width(vision_config) -> tuple[int, str] | None:
    """The values of one flattened patch, and how they are made, in words; None if the config does not say."""
    c, t, p = (getattr(vision_config, k, None) for k in ("in_channels", "temporal_patch_size", "patch_size"))
    if not all(isinstance(x, int) for x in (c, t, p)):
        return None
    return c * t * p * p, f"{c} channels x {t} frames x {p} x {p} pixels a patch"


class GridTower:
    """The vision tower of `module` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) run on tables computed from the step's
    real grids, constants of the trace, each grid recorded in `found`. inputs(): the model's traced
    input tensors; real: the same inputs as given, values and all."""

    def __init__(self, name: str, module: nn.Module, inputs, real: list[torch.Tensor],
                 found: dict[str, GridConstants]):
        self.name, self.module, self.inputs, self.real, self.found = name, module, inputs, real, found
        self.label = f"{type(module).__name__} ('{name}')"

    def features(self, media: str):
        """The model's get_image_features or get_video_features, at static shapes."""
        pixels, grid = MEDIA[media]

        def get_features(*args, **kwargs):
            given = dict(zip((pixels, grid), args)) | kwargs
            return self.encode([(media, given.pop(pixels), given.pop(grid, None))], given)[0]
        return get_features

    def encode(self, parts: list[tuple[str, torch.Tensor, torch.Tensor | None]], kwargs: dict) -> list:
        """One tower run over the parts' patches, concatenated: (media, pixels, grid input) each. The
        tower encodes each image, and each video frame pair by frame pair, on its own (its attention
        splits by them; Qwen2.5-VL's windows lie within them), so one run over images and videos
        gives what one run over each gives, and the tower's layers, streamed blocks, run once a step. Returns
        one output per part, as the model's get_<media>_features gives it: the pooled features split
        per image or video (Qwen3-VL's deepstack features likewise, or whole, as the model's own do)."""
        from transformers.utils.generic import is_flash_attention_requested
        visual = self.module.visual
        if is_flash_attention_requested(visual.config):
            raise CaptureError(f"{self.label}'s vision tower runs flash attention over packed images, which megacompile "
                               "does not train yet: load the model with attn_implementation='sdpa' or 'eager'")
        grids = [self._grid(media, grid) for media, _, grid in parts]
        for (media, pixels, _), values in zip(parts, grids):
            self._check_patches(media, pixels, values)
        values = sum(grids, ())
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            tables = {k: (v.tolist(), v.dtype) for k, v in _vision_tables(visual, torch.tensor(values)).items()}
        pixels = torch.cat([p for _, p, _ in parts]) if len(parts) > 1 else parts[0][1]
        grid_thw = torch.cat([g for _, _, g in parts]) if len(parts) > 1 else parts[0][2]   # read from the tables
        # The tables indexed with are made inside the trace: constants of the graph. The attention
        # only splits by the lengths between the cumulative ones (`lengths.tolist()`): they go in as
        # host arrays of numbers, so the split sizes are plain numbers when traced. Each table keeps
        # the dtype transformers' helper gave it (Qwen3-VL's interpolation weights: float32).
        lengths = ("cu_seqlens", "cu_window_seqlens")
        precomputed = {k: numpy.asarray(v) if k in lengths else torch.tensor(v, dtype=dtype, device=pixels.device)
                       for k, (v, dtype) in tables.items()}
        out = visual(pixels.type(visual.dtype), grid_thw=grid_thw, **{**kwargs, **precomputed})
        return self._per_part(out, grids)

    def _per_part(self, out, grids: list[tuple[tuple[int, ...], ...]]) -> list:
        """The tower's output split per part, and within a part per image or video (the deepstack
        features too, where the model's get_image_features splits them)."""
        merge = self.module.visual.spatial_merge_size ** 2
        items = [[t * h * w // merge for t, h, w in g] for g in grids]     # features of each image or video
        deepstack = getattr(out, "deepstack_features", None)                # Qwen3-VL's: [tokens, width] a merger
        if len(grids) == 1:
            parts, pooled, deep = [out], (out.pooler_output,), [(f,) for f in deepstack or []]
        else:
            parts = [type(out)(**out) for _ in grids]
            # Qwen2.5-VL's last hidden state is in window order, which keeps each image's patches together
            patches = [sum(t * h * w for t, h, w in g) for g in grids]
            for part, hidden in zip(parts, torch.split(out.last_hidden_state, patches)):
                part.last_hidden_state = hidden
            features = [sum(n) for n in items]
            pooled = torch.split(out.pooler_output, features)
            deep = [torch.split(f, features) for f in deepstack or []]
        split = deepstack is not None and self._splits_deepstack()
        for k, (part, n) in enumerate(zip(parts, items)):
            part.pooler_output = torch.split(pooled[k], n)
            if deepstack is not None:
                part.deepstack_features = [torch.split(d[k], n) if split else d[k] for d in deep]
        return parts

    def _splits_deepstack(self) -> bool:
        """Whether the model's own get_image_features splits the deepstack features per image
        (deepstack.splits_per_image): its forward takes them as that method gives them."""
        split = splits_per_image(type(self.module).get_image_features)
        if split is None:
            raise CaptureError(f"{self.label}'s get_image_features hands on its deepstack features otherwise than "
                               "transformers 5.17's (one tensor a merger) or 5.24's (split per image), the forms "
                               "megacompile gives its forward: train it with a transformers release whose "
                               "get_image_features does as one of those does")
        return split

    def _grid(self, media: str, grid_thw: torch.Tensor | None) -> tuple[tuple[int, ...], ...]:
        """The values of the grid input, recorded as a constant of the capture."""
        pixels, name = MEDIA[media]
        index = next((i for i, t in enumerate(self.inputs()) if t is grid_thw), None)
        if index is None or index >= len(self.real) or self.real[index].device.type == "meta":
            raise CaptureError(f"{self.label} was given {pixels}, and its {name} is not one of the model's inputs "
                               f"with values: pass {name} to the model, as its processor writes it")
        values = _grid(self.real[index])
        self.found[f"{self.name}:{name}"] = GridConstants(f"{type(self.module).__name__} at '{self.name}'", index,
                                                          name, values)
        return values

    def _check_patches(self, media: str, pixels: torch.Tensor, values: tuple[tuple[int, ...], ...]) -> None:
        """Patches the tower cannot take fail inside it, where the failure reads as a tracing one."""
        given, name = MEDIA[media]
        width = patch_width(self.module.visual.config)
        patches = sum(t * h * w for t, h, w in values)
        if width is None or tuple(pixels.shape) == (patches, width[0]):
            return
        raise InputMismatchError(
            f"{given} of shape {list(pixels.shape)} given to {self.label}, whose vision tower takes [{patches}, "
            f"{width[0]}] for the {name} {list(values)} ({width[1]}; one row per patch, a {media}'s patches in its "
            f"processor's order, {media}s one after another): make them with the model's own {media} processor")
