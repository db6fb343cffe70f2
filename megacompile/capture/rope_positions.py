"""Qwen2.5-VL's and Qwen3-VL's 3D (multimodal rotary) positions, computed before the step and passed as input.

Given no position_ids, these models build them in their forward (`compute_3d_position_ids`, which
calls `get_rope_index`): a text token advances all three position rows by one, an image's or a
video's tokens take (frame, row, column) positions from its grid. Qwen2.5-VL spaces a video's
frames by `second_per_grid_ts` times the vision config's `tokens_per_second`; Qwen3-VL splits each
video's grid into one grid per frame pair, whose tokens its processor writes apart (each after its
timestamp in text, between vision start and end tokens). That walks the ids and mm_token_type_ids
in Python (groups of token types, `.tolist()`), which does not trace. The positions are a function
of the step's inputs alone, so `with_rope_positions` runs the model's own `compute_3d_position_ids`
eagerly on the step's tensors before the step (on the host, before the budgeted device sees
anything) and passes its result as position_ids, an ordinary input of the captured graph;
second_per_grid_ts, read there only, is an input the graph leaves unread. What the model does with
position_ids (the rotary sections per axis) is traced as it is.

`compute_3d_position_ids` also keeps the step's rope deltas (how far each row's positions end from
its length) on the module, `rope_deltas`, and some transformers releases (5.17) return them in
the forward's output too, as the module holds them. In the traced forward they are a tensor the
module holds, not one the graph computes: the captured output holds `HeldRopeDeltas` there, read
from the module when a step's output is built, after with_rope_positions has set the step's.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import InputMismatchError
from .grid_constants import keys_grids


def _positions_module(model: nn.Module) -> tuple[str, nn.Module] | None:
    return next(((n, m) for n, m in model.named_modules() if keys_grids(m)), None)


@dataclass(frozen=True, eq=False)
class HeldRopeDeltas:
    """A leaf of a captured output: the rope deltas `module` holds when the step's output is built."""
    module: nn.Module

    def value(self) -> torch.Tensor | None:
        return self.module.rope_deltas


def held_rope_deltas(model: nn.Module) -> dict[int, HeldRopeDeltas]:
    """While tracing `model`: the rope deltas its positions module holds (by the tensor's id), which
    an output that returns them returns as they are held."""
    found = _positions_module(model)
    deltas = getattr(found[1], "rope_deltas", None) if found is not None else None
    return {} if not isinstance(deltas, torch.Tensor) else {id(deltas): HeldRopeDeltas(found[1])}


def with_rope_positions(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """kwargs with the 3D position_ids the model would compute from them, where it computes them
    from values (a Qwen2.5-VL or Qwen3-VL given images or videos, input_ids and mm_token_type_ids,
    and no position_ids); otherwise kwargs as they are."""
    if args or kwargs.get("position_ids") is not None:
        return kwargs
    found = _positions_module(model)
    if found is None or not isinstance(kwargs.get("input_ids"), torch.Tensor):
        return kwargs
    name, module = found
    if kwargs["input_ids"].device.type == "meta":
        return kwargs
    takes = inspect.signature(module.compute_3d_position_ids).parameters
    given = dict(input_ids=kwargs["input_ids"], image_grid_thw=kwargs.get("image_grid_thw"),
                 video_grid_thw=kwargs.get("video_grid_thw"), inputs_embeds=None,
                 attention_mask=kwargs.get("attention_mask"), mm_token_type_ids=kwargs.get("mm_token_type_ids"))
    given["cache" if "cache" in takes else "past_key_values"] = None
    if "second_per_grid_ts" in takes:   # Qwen2.5-VL's
        given["second_per_grid_ts"] = kwargs.get("second_per_grid_ts")
    try:
        with torch.no_grad():
            positions = module.compute_3d_position_ids(**given)
    except (StopIteration, RuntimeError, IndexError, TypeError, ValueError) as e:
        said = (str(e).strip().splitlines() or [""])[0]
        raise InputMismatchError(
            f"{type(module).__name__} at '{name or type(model).__name__}' cannot place its 3D positions for this "
            f"step ({type(e).__name__}: {said}): "
            "mm_token_type_ids must mark exactly the tokens of the images and videos image_grid_thw and "
            "video_grid_thw list (1 on image tokens, 2 on video tokens), one run of tokens per image and per "
            "video (Qwen3-VL: per frame pair, each after its timestamp), as the model's processor writes them") from e
    return kwargs if positions is None else {**kwargs, "position_ids": positions}
