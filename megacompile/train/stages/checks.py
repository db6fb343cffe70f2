"""What every stage's key checks share: numbers as run.yaml gives them, a loss type among a stage's,
and the run's notes."""
from __future__ import annotations

import math
from typing import Any

from ...errors import ArgumentError
from ..methods import adapters


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


def reference_updates(c, missing: str | None) -> None:
    """sync_ref_model and its two numbers: TRL's reference updates (TR-DPO), every
    ref_model_sync_steps steps the reference mixed with the policy; `missing`: why this run has no
    reference of its own to update (None: it has one)."""
    if not isinstance(c.sync_ref_model, bool):
        raise ArgumentError(f"sync_ref_model must be true or false; got {c.sync_ref_model!r}")
    c.ref_model_mixup_alpha = number("ref_model_mixup_alpha", c.ref_model_mixup_alpha)
    if not 0.0 <= c.ref_model_mixup_alpha <= 1.0:
        raise ArgumentError(f"ref_model_mixup_alpha must be in [0, 1] (the policy's share of the updated reference; "
                            f"TRL's default 0.6); got {c.ref_model_mixup_alpha!r}")
    steps = c.ref_model_sync_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ArgumentError(f"ref_model_sync_steps must be a whole number >= 1 (optimizer steps between reference "
                            f"updates; TRL's default 512); got {steps!r}")
    if not c.sync_ref_model:
        return
    if missing:
        raise ArgumentError(f"sync_ref_model updates the reference, and {missing}; or leave sync_ref_model out")
    if adapters(c):
        raise ArgumentError("sync_ref_model with finetuning_type lora: the reference is the model without its "
                            "adapters, which an update cannot mix into (TRL refuses it with PEFT too); train full "
                            "weights, or leave sync_ref_model out")
