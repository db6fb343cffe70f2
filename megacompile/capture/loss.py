"""Take the scalar loss out of whatever the model's forward returned, and the tensors it hands out
beside it (LossAndOutputs)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch

from ..errors import LossError

LossFn = Callable[..., torch.Tensor]


class LossAndOutputs(NamedTuple):
    """What a model's forward may return to hand out, beside its loss, a few tensors of the same
    forward (per-row log-probabilities, rewards): the step carries them out detached, no gradient
    through them, and the engine holds them after the step (`engine.last_outputs`). Values the
    loss reads come out as the loss read them, with no second forward for them. Eagerly it is a
    tuple `(loss, outputs)` with `.loss`, as a Hugging Face output has."""
    loss: torch.Tensor
    outputs: dict[str, torch.Tensor]


def extract_loss(output: Any, loss_fn: LossFn | None, args: tuple, kwargs: dict) -> torch.Tensor:
    """The loss as the model's forward (or `loss_fn`) gives it: a 0-d floating tensor (that it
    depends on something trainable is checked once the stages are traced: require_gradient).

    Accepted forms: a scalar tensor; an object with `.loss` (Hugging Face outputs); a dict (any
    Mapping) with a "loss" key, which transformers' Trainer reads as outputs["loss"]; a tuple or
    list holding exactly one scalar floating tensor that needs a gradient, wherever it sits
    (nanoGPT's `(logits, loss)`, transformers' `return_dict=False` tuples `(loss, logits, ...)`,
    `(loss, accuracy)`); or `loss_fn(output, *args, **kwargs)`. A tuple with several such scalars
    (`(loss, z_loss)`) is ambiguous and refused: which one, or which sum, is the user's to say.
    What else a dict, tuple or output object holds (logits) is not carried out of the step
    (extract_outputs: LossAndOutputs names what is).
    """
    if loss_fn is not None:
        loss, where = loss_fn(output, *args, **kwargs), "loss_fn(output, *args, **kwargs)"
    elif isinstance(output, torch.Tensor):
        loss, where = output, "the model's output"
    elif getattr(output, "loss", None) is not None:
        loss, where = output.loss, "output.loss"
    elif isinstance(output, Mapping) and output.get("loss") is not None:
        loss, where = output["loss"], "output['loss']"
    elif isinstance(output, (tuple, list)) and output:
        loss, where = _from_sequence(output)
    else:
        raise LossError(
            f"cannot find a loss in the model's output of type {type(output).__name__}: return a "
            "scalar tensor, an object with .loss, a dict with a 'loss' key, or a tuple holding the loss, or pass "
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


def extract_outputs(output: Any) -> dict[str, torch.Tensor]:
    """The tensors a LossAndOutputs hands out beside the loss, detached, by name ({} for any other
    output: only what the model names is carried out of the step)."""
    if not isinstance(output, LossAndOutputs):
        return {}
    if not isinstance(output.outputs, dict):
        raise LossError(f"LossAndOutputs.outputs is a dict of named tensors; got a {type(output.outputs).__name__}")
    for name, value in output.outputs.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise LossError(f"LossAndOutputs.outputs maps names (str) to tensors; got {name!r}: "
                            f"{type(value).__name__}")
    return {name: value.detach() for name, value in output.outputs.items()}


def require_gradient(needs_grad: bool) -> None:
    """Refuse a loss that depends on no trainable parameter, known once the stages are traced (the
    blocks are opaque to the model-level trace: a LoRA model's loss needs a gradient only through
    them). Trained, it would step every parameter on a zero gradient: weight decay alone."""
    if not needs_grad:
        raise LossError(
            "the loss does not depend on any trainable parameter (no gradient flows to it: a metric, a "
            "detached value, or a model whose parameters are all frozen on its path); return the loss the "
            "model trains on, or pass loss_fn=callable(output, *args, **kwargs) to megacompile.compile()"
        )


def _from_sequence(output: tuple | list) -> tuple[torch.Tensor, str]:
    """The one scalar floating tensor of `output` that needs a gradient (or the only scalar), and
    where it sits."""
    scalars = [i for i, x in enumerate(output)
               if isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype.is_floating_point]
    # Whether a value needs a gradient is known here only where a trainable parameter outside the
    # blocks feeds it (the blocks are opaque to this trace); else every scalar is a candidate.
    trained = [i for i in scalars if output[i].requires_grad] or scalars
    if len(trained) == 1:
        return output[trained[0]], f"element {trained[0]} of the output tuple"
    if len(trained) > 1:
        raise LossError(
            f"the model's output tuple holds {len(trained)} scalar tensors that need a gradient (elements "
            f"{', '.join(map(str, trained))}): which is the loss is ambiguous; pass "
            "loss_fn=lambda output, *args, **kwargs: output[i] (or the weighted sum you train on) to "
            "megacompile.compile()")
    shapes = ", ".join(str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in output)
    raise LossError(
        f"the model's output tuple ({shapes}) holds no scalar loss: call the model with the inputs that make "
        "it compute its loss (labels=, targets=), or pass loss_fn=callable(output, *args, **kwargs) to "
        "megacompile.compile()")
