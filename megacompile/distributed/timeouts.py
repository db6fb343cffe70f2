"""How long a rank waits in a collective for the others before it gives up (and says why: group.py).

torch's default is 30 minutes (10 for NCCL): a rank that dies or hangs holds every other one that
long. Here the wait follows the step:

    before a plan's first step, around checkpoints and exports   LONG (600 s): ranks may plan,
                                                                 trace, write and fsync at
                                                                 different speeds
    during the steps of a plan that has run                      max(STEP_FLOOR, STEP_MULTIPLE x
                                                                 the step's time), the step's time
                                                                 being the larger of the plan's
                                                                 prediction and the last measured

The floor leaves room for what a loop does between steps on one rank alone (logging, a short
evaluation, the garbage collector); the multiple for a step slower than predicted. A rank whose
peer died usually hears at once (the peer's sockets close); the timeout bounds the rest: a peer
that hangs, or a node that vanished without closing anything.

MEGACOMPILE_DIST_TIMEOUT=SECONDS fixes the wait everywhere instead.
"""
from __future__ import annotations

import os
from datetime import timedelta

from ..errors import ArgumentError

ENV = "MEGACOMPILE_DIST_TIMEOUT"
LONG = 600.0          # s
STEP_FLOOR = 120.0    # s
STEP_MULTIPLE = 20


def fixed() -> float | None:
    """MEGACOMPILE_DIST_TIMEOUT in seconds, or None when unset."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ArgumentError(f"{ENV} is the seconds a rank waits in a collective for the others; give a positive "
                            f"number, or unset it for a wait set from the step's time; got {value!r}")
    return seconds


def long() -> timedelta:
    """The wait before a plan's first step and around checkpoints and exports."""
    seconds = fixed()
    return timedelta(seconds=LONG if seconds is None else seconds)


def for_steps(predicted_s: float | None, measured_s: float | None) -> timedelta:
    """The wait during the steps of a plan that has run once here."""
    seconds = fixed()
    if seconds is None:
        step = max(s for s in (predicted_s, measured_s, 0.0) if s is not None)
        seconds = max(STEP_FLOOR, STEP_MULTIPLE * step)
    return timedelta(seconds=seconds)
