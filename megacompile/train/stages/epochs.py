"""How many optimizer steps an epoch is, and how that differs from transformers' Trainer.

A run's steps are whole: each takes `batch` items (rows, pairs, examples) `grad_accum` times,
and the items run on from one epoch into the next (order.py, data/packing.py), so `epochs` give
ceil(epochs * items / per_step) steps. The Trainer (LlamaFactory's and TRL's trainers) instead
ends each epoch with what is left: a last micro-batch short of `batch` and a last step short of
`grad_accum` micro-batches, ceil(epochs * ceil(ceil(items / batch) / grad_accum)) steps in all.
The two agree where an epoch is a whole number of steps; elsewhere the run says so before it
trains. The logged epoch is the items read over an epoch's (2.11 after 13 steps of 6 rows over
37), not a count of the Trainer's steps.
"""
from __future__ import annotations

import math


def per_step(c) -> int:
    """Items an optimizer step takes."""
    return c.global_batch or c.batch * c.grad_accum


def steps(c, items: int, epochs: float) -> int:
    """The run's steps for `epochs` passes over `items` an epoch."""
    return max(1, math.ceil(epochs * items / per_step(c)))


def trainer_steps(c, items: int, epochs: float) -> int:
    """The steps transformers' Trainer takes for the same epochs (its max_steps)."""
    micro = math.ceil(items / c.batch)
    return max(1, math.ceil(epochs * math.ceil(micro / c.grad_accum)))


def note(c, items: int, unit: str) -> list[str]:
    """A line where the run's epochs are not whole steps (with steps from `epochs`)."""
    if c.epochs is None or items % per_step(c) == 0:
        return []
    ours = steps(c, items, c.epochs)
    theirs = "" if c.global_batch else (
        f"; transformers' Trainer (LlamaFactory, TRL) ends each epoch with a shorter step: "
        f"{trainer_steps(c, items, c.epochs):,} steps")
    return [f"  epochs         {c.epochs:g} of {items:,} {unit} in {ours:,} steps of {per_step(c):,}: an epoch's last "
            f"{unit} share a step with the next epoch's first{theirs}"]
