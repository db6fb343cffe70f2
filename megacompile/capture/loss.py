"""Take the scalar loss out of whatever the model's forward returned."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import LossError

LossFn = Callable[..., torch.Tensor]


def extract_loss(output: Any, loss_fn: LossFn | None, args: tuple, kwargs: dict) -> torch.Tensor:
    """The loss as the model's forward (or `loss_fn`) gives it; must be a 0-d floating tensor.

    Accepted forms: a scalar tensor; an object with `.loss` (Hugging Face outputs); a tuple whose
    last element is the loss (nanoGPT's `(logits, loss)`); or `loss_fn(output, *args, **kwargs)`.
    """
    if loss_fn is not None:
        loss, where = loss_fn(output, *args, **kwargs), "loss_fn(output, *args, **kwargs)"
    elif isinstance(output, torch.Tensor):
        loss, where = output, "the model's output"
    elif getattr(output, "loss", None) is not None:
        loss, where = output.loss, "output.loss"
    elif isinstance(output, (tuple, list)) and output and isinstance(output[-1], torch.Tensor):
        loss, where = output[-1], "the last element of the output tuple"
    else:
        raise LossError(
            f"cannot find a loss in the model's output of type {type(output).__name__}: return a "
            "scalar tensor, an object with .loss, or a tuple ending in the loss, or pass "
            "loss_fn=callable(output, *args, **kwargs) to megacompile.compile()"
        )
    if not isinstance(loss, torch.Tensor):
        raise LossError(f"{where} is a {type(loss).__name__}, not a tensor: the loss must be a scalar tensor")
    if loss.dim() != 0:
        raise LossError(
            f"{where} has shape {tuple(loss.shape)}; the loss must be a scalar (0-d) tensor: "
            "reduce it (e.g. .mean()) in the model or in loss_fn"
        )
    if not loss.dtype.is_floating_point:
        raise LossError(f"{where} has dtype {loss.dtype}; the loss must be floating point")
    return loss
