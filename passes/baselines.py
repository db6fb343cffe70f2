"""Other systems' schedules, expressed in megacompile's IR so the same cost model times them.

- "megatrain": per-layer streaming with double buffers, every block's forward run three times
  per step (the first forward keeps nothing, the backward runs two more), weights over the link
  three times per step, the optimizer after the whole backward and not overlapped.
- "zero3": ZeRO-3 with CPU offload as usually run: weights fetched on demand (no prefetch
  overlap), every block recomputed (activation checkpointing), optimizer after the backward.

These are models of the published schedules, for comparison: they run the same graphs with the
same kernels, so differences come from the schedule alone (not, e.g., from MegaTrain's bf16
masters or DeepSpeed's runtime hooks).
"""
from __future__ import annotations

from typing import Sequence

from .pipeline import ScheduleChoice


def baseline_choice(style: str, blocks: Sequence[int]) -> ScheduleChoice:
    every = frozenset(blocks)
    if style == "megatrain":
        return ScheduleChoice(1, every, extra_forwards=1, refetch_per_pass=True, serial_optimizer=True)
    if style == "zero3":
        return ScheduleChoice(0, every, serial_optimizer=True)
    raise ValueError(f"unknown schedule style {style!r}: 'megatrain' or 'zero3'")


STYLES = ("megatrain", "zero3")
