"""Which held parameters a step's program gives a gradient, checked before it runs.

A program traced from inputs that skip part of the model (a LLaVA batch without pixel_values
runs neither the vision tower nor the projector) produces no gradient for that part's
parameters. Eager torch leaves their .grad None and torch.optim.AdamW skips them: no moment
decay, no weight decay, no advance of their own step count. The host update does the same: each
micro-batch tells the host state which parameters its program reaches (known from the graph
alone, whatever values the inputs hold), and the update steps only those the step's micro-batches
reached, each with its own count (runtime/host.py schedule_updates; docs/decisions.md, "A
parameter without a gradient keeps its state").

The host state lays out every trainable parameter of the model, those the first program does not
reach in the prologue's owner (runtime/host.py), so a program checked here must agree with that
layout: each of its owning stages holds parameters of one host owner (runtime/host.py owner_map:
a later program may cut the model into other stages), and a parameter it uses from
several stages (a tied embedding) sits in an owner laid out to sum them. With data parallelism the
ranks also settle, before the program runs, what their programs reach: a parameter some rank
reaches is stepped on every rank, with a zero gradient from the ranks that did not reach it, as
eager DDP steps it (distributed/reach.py); only one no rank reaches is skipped.
"""
from __future__ import annotations

from ..capture import CapturedModel
from ..errors import InputMismatchError
from ..runtime.host import owner_map, program_uses

_NAMED = 6     # parameters named in a message; the rest are counted


def with_gradient(captured: CapturedModel) -> set[str]:
    """The trainable parameters some stage of `captured` produces a gradient for: known from the
    graph alone, whatever values the inputs hold."""
    return {name for stage in captured.stages
            for name, slot in zip(stage.params, stage.template.params) if slot.trainable}


def gradient_order(captured: CapturedModel) -> list[str]:
    """The trainable parameters as the backward hands their gradients over: the stages last to
    first, each stage's in its own order (runtime/executor.py's gradient OFFLOAD), a parameter
    once per stage that uses it."""
    return [stage.params[i] for stage in reversed(captured.stages) for i in stage.template.grad_params]


def enter_program(captured: CapturedModel, host, data_parallel: bool) -> None:
    """Refuse a program the host state cannot step exactly, else tell the host state what it
    reaches (with data parallelism, a collective: the ranks settle what theirs reach). Nothing has
    run yet."""
    produced = with_gradient(captured)
    held = host.slots
    unheld = sorted(produced - held.keys())
    if unheld:
        raise InputMismatchError(
            f"step() got inputs whose forward reaches {len(unheld)} trainable parameters ({_names(unheld)}) "
            "that the host state (masters and AdamW moments) does not hold: they were not trainable when it was "
            "laid out, at the first step; nothing was run. Set requires_grad before compile(), or compile the "
            "model again")
    elsewhere = owner_map(captured, held)[1]
    if elsewhere:
        raise InputMismatchError(
            f"step() got inputs whose program runs {len(elsewhere)} trainable parameters ({_names(elsewhere)}) in "
            "one stage that the host state placed in several (laid out from the first step's program, the ones "
            "it did not reach in the prologue's); nothing was run. Give the first step inputs that reach every "
            "parameter later steps train (for a vision-language model: an image, with its pixel_values), or "
            "freeze them (param.requires_grad_(False)) before compile()")
    uses = program_uses(captured, held)
    unsummed = sorted(n for n, k in uses.items() if k > 1 and held[n].owner not in host.summed_owners)
    if unsummed:
        raise InputMismatchError(
            f"step() got inputs whose program uses {len(unsummed)} trainable parameters ({_names(unsummed)}) from "
            "several stages, which the first step's program did not, so the host state has no sum for their "
            "gradients; nothing was run. Give the first step inputs that reach every parameter later steps "
            "train, or freeze them (param.requires_grad_(False)) before compile()")
    host.enter_program(uses, gradient_order(captured) if data_parallel else None)


def _names(names: list[str]) -> str:
    more = len(names) - _NAMED
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")
