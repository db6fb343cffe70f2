"""Image grids (Qwen2.5-VL's image_grid_thw) as constants of the capture, keyed like shapes.

Qwen2.5-VL's vision tower reads each image's grid of patches (frames, rows, columns) in Python:
its rotary table (`get_vision_position_ids`), the lengths its attention splits by (`cu_seqlens`,
read with `.tolist()` in every tower layer), its window index and window lengths, and the split of
its features per image. None of that traces over a tensor whose values are unknown. The grids are
known before the step runs, though: they describe pixel_values' layout, as shapes do. So the
capture takes them as constants: the static `get_image_features` below computes those tables
eagerly from the step's real grid with transformers' own helpers (`transformers.vision_utils`),
and hands them to the tower as the precomputed inputs it accepts; in the graph they are constants,
and the lengths the attention splits by are plain numbers.

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

# The model classes whose vision tower reads its grid's values; the names of those inputs.
_FAMILIES = {("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
             ("transformers.models.qwen3_vl.modeling_qwen3_vl", "Qwen3VLModel"),
             ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeModel")}
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
    """The grid-dependent tables the tower computes, from a real grid, on the host: Qwen2.5-VL's
    windows, or Qwen3-VL's resampling of its learned position grid to each image's."""
    from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                           get_vision_position_ids, get_vision_window_index)
    config = visual.config
    if hasattr(visual, "num_grid_per_side"):      # Qwen3-VL
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=config.spatial_merge_size)
        return {"position_ids": get_vision_position_ids(grid, config.spatial_merge_size),
                "cu_seqlens": get_vision_cu_seqlens(grid), "interp_indices": indices, "interp_weights": weights}
    window_index, cu_window_seqlens = get_vision_window_index(grid, config.spatial_merge_size, config.window_size,
                                                              config.patch_size)
    return {"position_ids": get_vision_position_ids(grid, config.spatial_merge_size),
            "cu_seqlens": get_vision_cu_seqlens(grid), "window_index": window_index,
            "cu_window_seqlens": cu_window_seqlens}


def static_grid_features(name: str, module: nn.Module, inputs, real: list[torch.Tensor],
                         found: dict[str, GridConstants]):
    """A get_image_features for `module` (Qwen2.5-VL, Qwen3-VL) that runs its tower on tables computed from
    the step's real grids, as constants of the trace; records them in found[name].
    inputs(): the model's traced input tensors; real: the same inputs as given, values and all."""
    label = f"{type(module).__name__} ('{name}')"

    from transformers.utils.generic import is_flash_attention_requested

    def get_image_features(pixel_values, image_grid_thw=None, **kwargs):
        index = next((i for i, t in enumerate(inputs()) if t is image_grid_thw), None)
        if index is None or index >= len(real) or real[index].device.type == "meta":
            raise CaptureError(f"{label} was given an image_grid_thw that is not one of the model's inputs with "
                               "values: pass image_grid_thw to the model, as its processor writes it")
        if is_flash_attention_requested(module.visual.config):
            raise CaptureError(f"{label}'s vision tower runs flash attention over packed images, which megacompile "
                               "does not train yet: load the model with attn_implementation='sdpa' or 'eager'")
        values = _grid(real[index])
        with unset_fake_temporarily(), disable_proxy_modes_tracing():
            tables = {k: (v.tolist(), v.dtype) for k, v in _vision_tables(module.visual, torch.tensor(values)).items()}
        # The tables indexed with are made inside the trace: constants of the graph. The attention
        # only splits by the lengths between the cumulative ones (`lengths.tolist()`): they go in as
        # host arrays of numbers, so the split sizes are plain numbers when traced. Each table keeps
        # the dtype transformers' helper gave it (Qwen3-VL's interpolation weights: float32).
        lengths = ("cu_seqlens", "cu_window_seqlens")
        precomputed = {k: numpy.asarray(v) if k in lengths else torch.tensor(v, dtype=dtype, device=pixel_values.device)
                       for k, (v, dtype) in tables.items()}
        out = module.visual(pixel_values.type(module.visual.dtype), grid_thw=image_grid_thw,
                            **{**kwargs, **precomputed})
        merge = module.visual.spatial_merge_size ** 2
        sizes = [t * h * w // merge for t, h, w in values]
        out.pooler_output = torch.split(out.pooler_output, sizes)
        if getattr(out, "deepstack_features", None) is not None:    # Qwen3-VL's, split per image likewise
            out.deepstack_features = [torch.split(f, sizes) for f in out.deepstack_features]
        found[name] = GridConstants(f"{type(module).__name__} at '{name}'", index, "image_grid_thw", values)
        return out
    return get_image_features
