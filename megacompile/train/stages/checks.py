"""What every stage's key checks share: numbers as run.yaml gives them, a loss type among a stage's,
and the run's notes."""
from __future__ import annotations

import math
from typing import Any

from ...errors import ArgumentError


def note(text: str) -> None:
    print(f"  note           {text}", flush=True)


def loss_type_in(c, allowed: tuple) -> None:
    if c.loss_type not in allowed:
        raise ArgumentError(f"loss_type for stage {c.stage} must be one of {', '.join(allowed)}; got {c.loss_type!r}")


def number(key: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)        # YAML reads 1e-3 (no dot) as a string
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ArgumentError(f"{key} must be a number; got {value!r}")
    return float(value)


def positive(key: str, value: Any) -> float:
    checked = number(key, value)
    if checked <= 0:
        raise ArgumentError(f"{key} must be a positive number, e.g. 0.1; got {value!r}")
    return checked
