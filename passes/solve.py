"""Choose the schedule: the first candidate, in order of expected speed, whose peak fits.

Candidates: prefetch depth 1 (weights double-buffered, copies hidden behind compute) before
depth 0; within a depth, recompute the first k blocks for k = 0, 1, ..., n (the earliest
blocks' saved activations live longest, so dropping them lowers the peak most). The peak does
not rise with k, so k is found by bisection. The solver sees only a function from choice to
peak bytes: it knows nothing of graphs.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .pipeline import ScheduleChoice


def candidates(blocks: Sequence[int], depth: int) -> list[ScheduleChoice]:
    return [ScheduleChoice(depth, frozenset(blocks[:k])) for k in range(len(blocks) + 1)]


def solve(blocks: Sequence[int], budget_bytes: int,
          peak_of: Callable[[ScheduleChoice], int]) -> tuple[ScheduleChoice | None, int]:
    """The fastest choice that fits (None if none does) and the smallest peak any choice reaches."""
    minimum = None
    for depth in (1, 0):
        options = candidates(blocks, depth)
        lo, hi = 0, len(options) - 1
        if peak_of(options[hi]) > budget_bytes:
            low_peak = peak_of(options[hi])
            minimum = low_peak if minimum is None else min(minimum, low_peak)
            continue
        while lo < hi:   # first k whose peak fits
            mid = (lo + hi) // 2
            if peak_of(options[mid]) <= budget_bytes:
                hi = mid
            else:
                lo = mid + 1
        return options[lo], peak_of(options[-1])
    return None, minimum
