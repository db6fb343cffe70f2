"""Qwen2.5-VL's and Qwen3-VL's 3D (multimodal rotary) positions, computed before the step and passed as input.

Given no position_ids, Qwen2.5-VL builds them in its forward (`compute_3d_position_ids`, which
calls `get_rope_index`): a text token advances all three position rows by one, an image's tokens
take (frame, row, column) positions from its grid. That walks the ids and mm_token_type_ids in
Python (groups of token types, `.tolist()`), which does not trace. The positions are a function of
the step's inputs alone, so `with_rope_positions` runs the model's own `compute_3d_position_ids`
eagerly on the step's tensors before the step (on the host, before the budgeted device sees
anything) and passes its result as position_ids, an ordinary input of the captured graph. What the
model does with position_ids (the rotary sections per axis) is traced as it is.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ..errors import InputMismatchError
from .grid_constants import keys_grids


def _positions_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    return next(((n, m) for n, m in model.named_modules() if keys_grids(m)), None)


def with_rope_positions(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """kwargs with the 3D position_ids the model would compute from them, where it computes them
    from values (a Qwen2.5-VL given images, input_ids and mm_token_type_ids, and no position_ids);
    otherwise kwargs as they are."""
    if args or kwargs.get("position_ids") is not None:
        return kwargs
    found = _positions_module(model)
    if found is None or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        return kwargs
    name, module = found
    if kwargs["input_ids"].device.type == "meta":
        return kwargs
    given = dict(input_ids=kwargs["input_ids"], image_grid_thw=kwargs.get("image_grid_thw"),
                 video_grid_thw=kwargs.get("video_grid_thw"), inputs_embeds=None,
                 attention_mask=kwargs.get("attention_mask"), past_key_values=None,
                 mm_token_type_ids=kwargs.get("mm_token_type_ids"))
    if "second_per_grid_ts" in inspect.signature(module.compute_3d_position_ids).parameters:   # Qwen2.5-VL's
        given["second_per_grid_ts"] = kwargs.get("second_per_grid_ts")
    try:
        with torch.no_grad():
            positions = module.compute_3d_position_ids(**given)
    except (StopIteration, RuntimeError, IndexError, TypeError) as e:
        raise InputMismatchError(
            f"{type(module).__name__} at '{name or type(model).__name__}' cannot place its 3D positions for this "
            f"step ({type(e).__name__}: {e}): mm_token_type_ids must mark exactly the tokens of the images "
            "image_grid_thw lists, one run of image tokens per image, as the model's processor writes them") from e
    return kwargs if positions is None else {**kwargs, "position_ids": positions}
