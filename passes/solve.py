"""Choose the schedule: the fastest predicted choice whose simulated peak fits the budget.

Choices: how many compute nodes ahead weights are prefetched (depth 0, 1, 2), which blocks keep
their saved activations in host memory (offload) and which are recomputed, and whether the small
stages (embeddings, head) stay resident for the step. For a depth, recomputing the first k blocks (the earliest blocks' saved
activations live longest, so dropping them lowers the peak most) never raises the peak and
never speeds the step up, so the best k is the smallest that fits, found by bisection. The
solver then takes the fastest depth. It sees two functions, choice -> peak bytes and choice ->
predicted seconds, and knows nothing of graphs.

Monotone in the budget: a larger budget only adds feasible choices, so the chosen step is never
slower, and its peak is within the budget by construction.
"""
from __future__ import annotations

from typing import Callable, Sequence

from .pipeline import ScheduleChoice

DEPTHS = (2, 1, 0)


def candidates(blocks: Sequence[int], depth: int, resident: frozenset[int] = frozenset(),
               offloaded: int = 0, lag: int = 1) -> list[ScheduleChoice]:
    """The first `offloaded` blocks keep their saved values in host memory; of the rest, the
    first k are recomputed, for k = 0 .. all."""
    stash, rest = frozenset(blocks[:offloaded]), blocks[offloaded:]
    return [ScheduleChoice(depth, frozenset(rest[:k]), resident, offload=stash, offload_lag=lag)
            for k in range(len(rest) + 1)]


def smallest_fit(options: list[ScheduleChoice], budget_bytes: int,
                 peak_of: Callable[[ScheduleChoice], int]) -> ScheduleChoice | None:
    if peak_of(options[-1]) > budget_bytes:
        return None
    lo, hi = 0, len(options) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if peak_of(options[mid]) <= budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return options[lo]


def solve(blocks: Sequence[int], budget_bytes: int, peak_of: Callable[[ScheduleChoice], int],
          seconds_of: Callable[[ScheduleChoice], float] | None = None,
          residents: Sequence[frozenset[int]] = (frozenset(),),
          offload_counts: Sequence[int] = (0,), offload_lag: int = 1) -> tuple[ScheduleChoice | None, int]:
    """The fastest choice that fits (None if none does), and the smallest peak any choice reaches.

    `residents`: sets of stages that may be kept on the device for the whole step (fetched once,
    not twice). `offload_counts`: how many of the first blocks may keep their saved activations in
    host memory instead (each count is a family of candidates). Without `seconds_of`, deeper
    prefetch and fewer recomputed blocks count as faster."""
    fits = [c for c in (smallest_fit(candidates(blocks, d, r, j, offload_lag), budget_bytes, peak_of)
                        for d in DEPTHS for r in residents for j in offload_counts) if c]
    minimum = min(peak_of(candidates(blocks, d)[-1]) for d in DEPTHS)
    if not fits:
        return None, minimum
    if seconds_of is None:
        return min(fits, key=lambda c: (len(c.recompute), -c.prefetch_depth)), minimum
    return min(fits, key=lambda c: (seconds_of(c), len(c.recompute), len(c.offload), -c.prefetch_depth,
                                    len(c.resident))), minimum
