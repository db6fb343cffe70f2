"""Steps whose program trains another set of parameters than the host state holds, refused
before they run.

A program traced from inputs that skip part of the model (a LLaVA batch without pixel_values
runs neither the vision tower nor the projector) produces no gradient for that part's
parameters. Eager torch leaves their .grad None and torch.optim.AdamW then skips them: no
moment decay, no weight decay, no advance of their own step count. The host update steps whole
owners with one step count, so it cannot match that: such a step is refused, by name, before
anything runs (docs/decisions.md, "A parameter without a gradient").

The host state holds the parameters the first step's program reaches (one no program reaches,
such as a vision tower's unused last norm, keeps its value, as under torch.optim.AdamW); a later
program that reaches one it does not hold is refused too.
"""
from __future__ import annotations

from ..capture import CapturedModel
from ..errors import InputMismatchError

_NAMED = 6     # parameters named in a message; the rest are counted


def with_gradient(captured: CapturedModel) -> set[str]:
    """The trainable parameters some stage of `captured` produces a gradient for: known from the
    graph alone, whatever values the inputs hold."""
    return {name for stage in captured.stages
            for name, slot in zip(stage.params, stage.template.params) if slot.trainable}


def refuse_other_parameters(captured: CapturedModel, held: list[str]) -> None:
    """`held`: the host state's trainable parameters, in its order."""
    produced = with_gradient(captured)
    missing = [name for name in held if name not in produced]
    if missing:
        raise InputMismatchError(
            f"step() got inputs whose forward does not reach {len(missing)} trainable parameters "
            f"({_names(missing)}), so this step would give them no gradient; torch.optim.AdamW skips such "
            "parameters for the step, which megacompile's host update does not do; nothing was run. Freeze "
            "them (param.requires_grad_(False)) before compile(), or give every micro-batch inputs that use "
            "them (for a vision-language model: at least one image, with its pixel_values, in every micro-batch)")
    held_set = set(held)
    unheld = sorted(produced - held_set)
    if unheld:
        raise InputMismatchError(
            f"step() got inputs whose forward reaches {len(unheld)} trainable parameters ({_names(unheld)}) "
            "that the first step's inputs did not reach, and the host state (masters and AdamW moments) "
            "was laid out from that first step; nothing was run. Give the first step inputs that reach "
            "every parameter later steps train (for a vision-language model: an image, with its "
            "pixel_values, in every micro-batch), or freeze them (param.requires_grad_(False)) before compile()")


def _names(names: list[str]) -> str:
    more = len(names) - _NAMED
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")
