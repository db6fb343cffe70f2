"""MEGACOMPILE_INJECT_DELAYS: random sleeps in the stream threads, to shake out races.

With the variable set to an int seed ("1" will do), every task a copy stream runs (prefetch on
h2d, offload and gradient sinks on d2h) first sleeps a random 0-5 ms, and every task of the host
stream (the AdamW updates) 0-50 ms. A correct schedule waits on events for everything it reads,
so training with the delays must be bit-identical to training without them; a missing WAIT
shows up as a different loss or weight. Unset, empty or "0": the streams get no hook at all.
"""
from __future__ import annotations

import os
import random
import time
from typing import Callable

from ..errors import ArgumentError

ENV = "MEGACOMPILE_INJECT_DELAYS"
MOST_SECONDS = {"host": 0.050}   # the optimizer lags most; any other stream: DEFAULT_MOST
DEFAULT_MOST = 0.005


def injected_delay(stream: str) -> Callable[[], None] | None:
    """The sleep a stream runs before each task, or None when injection is off."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0"):
        return None
    try:
        seed = int(value)
    except ValueError:
        raise ArgumentError(f"{ENV} is a random seed (an int; 0 or unset turns delays off), got {value!r}") from None
    rng = random.Random(f"{seed}:{stream}")
    most = MOST_SECONDS.get(stream, DEFAULT_MOST)
    return lambda: time.sleep(rng.uniform(0.0, most))
