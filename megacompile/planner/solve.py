"""Choose the schedule: the fastest predicted choice whose simulated peak fits the budget.

Per block there are four ways to hold what its backward needs, from fastest and largest to
slowest and smallest: keep every saved value on the device; keep only the costly ones (matmul
and attention outputs) and recompute the cheap ops in the backward ("selective", see
capture/split.py); send the saved values to host memory and bring them back (offload: free on
the device, paid in link time); recompute the whole block forward (one block input kept). A
block offloaded or recomputed may also send that input to host memory until its backward half
(passes/boundary.py): then it holds nothing on the device between its passes.

The solver also picks how many compute nodes ahead weights are prefetched (depth 0, 1, 2) and
whether the small stages (embeddings) stay resident for the step. Families of candidates fix
depth, residents, how many of the first blocks are offloaded and which blocks save selectively,
and whether every m-th of those first blocks is recomputed instead (`stride`: where the forward
is bound by the activation copies, a recompute spread through the offloaded stretch frees link
time in every stretch of m blocks, not in one stretch at its end); within a family, recomputing the first k of the remaining blocks (the earliest blocks' saved
values live longest, so dropping them lowers the peak most) never raises the peak and never
speeds the step up, so the best k is the smallest that fits, found by bisection. The solver then
takes the fastest family's choice. It sees two functions, choice -> peak bytes and choice ->
predicted seconds, and knows nothing of graphs.

Monotone in the budget: a larger budget only adds feasible choices, so the chosen step is never
slower, and its peak is within the budget by construction.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from ..passes.pipeline import ScheduleChoice

DEPTHS = (2, 1, 0)


class Selective(enum.Enum):
    """Which blocks run the template variant that saves only costly values."""
    NONE = "none"
    KEPT = "kept"    # the blocks not recomputed: their saved values are what selective shrinks
    ALL = "all"      # recomputed blocks too: a smaller saved set during their backward


@dataclass(frozen=True)
class Family:
    depth: int
    resident: frozenset[int] = frozenset()
    offloaded: int = 0                   # the first blocks whose saved values go to host memory
    selective: Selective = Selective.NONE
    lag: int = 1                         # compute nodes an activation copy runs beside
    boundary: bool = False               # blocks offloaded or recomputed also send their input to host memory
    stride: int = 0                      # m > 0: of the first `offloaded` blocks, every m-th (from the
                                         # first) is recomputed instead of offloaded


class Candidates(Sequence[ScheduleChoice]):
    """The family's choices, k = 0 .. all of the blocks after the offloaded stretch recomputed, in
    order; each made when asked for (bisection reads about log2(n) of them)."""

    def __init__(self, blocks: Sequence[int], family: Family):
        self.blocks, self.family = list(blocks), family
        stretch = self.blocks[:family.offloaded]
        self.spread = frozenset(stretch[::family.stride]) if family.stride else frozenset()
        self.stash, self.rest = frozenset(stretch) - self.spread, self.blocks[family.offloaded:]

    def __len__(self) -> int:
        return len(self.rest) + 1

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        f, stash = self.family, self.stash
        recompute = self.spread | frozenset(self.rest[:k])
        selective = {Selective.NONE: frozenset(), Selective.ALL: frozenset(self.blocks),
                     Selective.KEPT: frozenset(self.blocks) - recompute}[f.selective]
        boundary = stash | recompute if f.boundary else frozenset()
        return ScheduleChoice(f.depth, recompute, f.resident, offload=stash,
                              offload_lag=f.lag if stash or boundary else 1, selective=selective, boundary=boundary)


def candidates(blocks: Sequence[int], family: Family) -> Candidates:
    return Candidates(blocks, family)


def smallest_fit(options: Sequence[ScheduleChoice], budget_bytes: int,
                 peak_of: Callable[[ScheduleChoice], int], last: int | None = None) -> ScheduleChoice | None:
    """The first choice whose peak fits, by bisection (None if the last does not fit). With `last`,
    None too as soon as the answer must lie past index `last`: the probes up to then are those of
    the whole bisection, so a fit at or before it is the same one."""
    if peak_of(options[0]) <= budget_bytes:
        return options[0]
    if last is not None and last < 1:
        return None
    if peak_of(options[-1]) > budget_bytes:
        return None
    lo, hi = 0, len(options) - 1
    while lo < hi:
        if last is not None and lo > last:
            return None
        mid = (lo + hi) // 2
        if peak_of(options[mid]) <= budget_bytes:
            hi = mid
        else:
            lo = mid + 1
    return None if last is not None and lo > last else options[lo]


def families(residents: Sequence[frozenset[int]] = (frozenset(),), offload_counts: Sequence[int] = (0,),
             selective: Sequence[Selective] = (Selective.NONE,),
             lag_of: Callable[[Selective], int] = lambda _: 1, boundaries: Sequence[bool] = (False,),
             strides: Sequence[int] = (0,)) -> list[Family]:
    """Every combination; a stride m > 0 only with an offloaded stretch of at least 2m blocks (a
    shorter one is the prefix family less a block or two)."""
    return [Family(d, r, j, s, lag_of(s), b, m) for d in DEPTHS for r in residents for j in offload_counts
            for s in selective for b in boundaries for m in strides if m == 0 or j >= 2 * m]


def lowest(blocks: Sequence[int], options: Sequence[Family],
           peak_of: Callable[[ScheduleChoice], int]) -> ScheduleChoice:
    """The choice of the smallest peak the families reach: every block recomputed, at each of their
    depths, selective sets, lags and boundaries (the first of equal peaks)."""
    return min((candidates(blocks, Family(f.depth, selective=f.selective, lag=f.lag, boundary=f.boundary))[-1]
                for f in options), key=peak_of)


def _clearly_above(floor: float, bar: float) -> bool:
    """Whether a floor is above `bar` by more than float noise and the rounding of seconds to the
    nanosecond below (so the prediction it bounds is above the bar too)."""
    return floor * (1 - 1e-9) > bar + 2e-9


def _plain(f: Family) -> bool:
    """Whether a family's first choice keeps every block whole: no offload, selective or boundary."""
    return not (f.offloaded or f.stride or f.boundary) and f.selective is Selective.NONE


def solve(blocks: Sequence[int], budget_bytes: int, peak_of: Callable[[ScheduleChoice], int],
          seconds_of: Callable[[ScheduleChoice], float] | None = None,
          options: Sequence[Family] | None = None,
          exact_of: Callable[[ScheduleChoice], float] | None = None,
          bound: float = float("inf"),
          floor_of: Callable[[ScheduleChoice], float] | None = None) -> tuple[ScheduleChoice | None, int]:
    """The fastest choice that fits (None if none does), and the smallest peak any choice reaches.

    `options`: the families to search (default: the three depths, nothing else). Without
    `seconds_of`, deeper prefetch and fewer recomputed blocks count as faster. `seconds_of` may be
    an estimate that ranks choices of one shape of pattern well but not different shapes against
    each other (planner/shorten.py judges a strided pattern by its periods): with `exact_of`, the
    fastest choice of each stride (0: prefix/suffix) by `seconds_of` is timed by `exact_of`, and
    the fastest of those wins. `bound`: seconds a choice must not exceed to be worth finding (a
    choice the caller already holds; None is returned when no choice found is within it).
    `floor_of`: seconds that `seconds_of` never undercuts, cheaper to know (planner/floor.py): a
    family whose fastest choice's floor is above the bar (the fastest fit of its stride so far, or
    `bound`) is skipped without asking `seconds_of`, and a family's bisection stops once its fit
    could only be above that bar; with `exact_of` too, a strided family's bar is also the exact
    seconds of the fastest prefix fit. None of the skips changes the choice returned
    (tests/unit/test_floor.py holds the floor under what it bounds, tests/unit/test_solve_pruning.py
    the choice to that of every family searched in full)."""
    options = list(options or families())
    # Every block recomputed holds the least any family can: no choice fits below it. At a budget
    # below it (the usual first try of a model that needs its blocks in sequence chunks), the
    # search of every family would only confirm that.
    minimum = peak_of(lowest(blocks, options, peak_of))
    if minimum > budget_bytes:
        return None, minimum
    # The same holds at each depth: no family of a depth whose choices of every block recomputed
    # do not fit can fit (deep prefetch at a tight budget is most of the families, each asked twice).
    too_deep = {d for d in {f.depth for f in options}
                if peak_of(lowest(blocks, [f for f in options if f.depth == d], peak_of)) > budget_bytes}
    fits: list[ScheduleChoice] = []
    stride_of: dict[ScheduleChoice, int] = {}
    settled: set[tuple] = set()
    outrun: set[tuple] = set()        # (depth, resident) pairs whose plain choice is slower than the bar
    fastest: dict[int, float] = {}    # per stride, the fastest fit so far (with seconds_of)
    # The prefix families first (each stride's search is its own, so the order changes no fit):
    # then the strided ones meet a ceiling, the exact seconds of the fastest prefix fit. A strided
    # choice whose floor is above it loses the final comparison to that fit, so it is never
    # sought; without it, another choice may be the fastest of its stride by the estimate, and it
    # reaches the final comparison only if its exact seconds are lower still.
    ceiling = None
    for f in [f for f in options if not f.stride] + [f for f in options if f.stride]:
        # Once a depth and resident set fit with every block kept whole, the other families of
        # that pair only add work (offload traffic, recompute, redone cheap ops): skip them.
        if (f.depth, f.resident) in settled or f.depth in too_deep:
            continue
        # For the same reason, once a pair's choice with every block kept whole is slower than the
        # fastest prefix fit, its other prefix families (which add work to it) are slower too.
        if not f.stride and (f.depth, f.resident) in outrun:
            continue
        options_f = candidates(blocks, f)
        # A family's fastest choice is its first (more recompute never speeds a step up): when that
        # is slower than a fit of the same stride already found, or than `bound`, its search cannot
        # win. Deep prefetch comes first and usually fits fast, so most families end here, at one
        # schedule each instead of a bisection's dozen.
        # With no fit of its stride yet and no bound, there is no bar to judge it against.
        bar = min(fastest.get(f.stride, float("inf")), bound)
        if f.stride and ceiling is None:
            ceiling = _exact_fastest(fits, seconds_of, exact_of) if floor_of is not None else float("inf")
        floor_bar = min(bar, ceiling) if f.stride else bar
        if seconds_of is not None and floor_of is not None and _clearly_above(floor_of(options_f[0]), floor_bar):
            continue
        if seconds_of is not None and bar < float("inf") and round(seconds_of(options_f[0]), 9) > round(bar, 9):
            if _plain(f) and bar == fastest.get(0):
                outrun.add((f.depth, f.resident))
            continue
        # A fit whose floor is above the bar could be neither the fastest of its stride nor within
        # `bound` (nor, strided, below the ceiling): the bisection gives up once its answer lies past
        # the last choice that might be.
        last = None
        if seconds_of is not None and floor_of is not None and floor_bar < float("inf"):
            last = next((k for k in reversed(range(len(options_f)))
                         if not _clearly_above(floor_of(options_f[k]), floor_bar)), -1)
        choice = smallest_fit(options_f, budget_bytes, peak_of, last)
        if choice is None:
            continue
        fits.append(choice)
        stride_of.setdefault(choice, f.stride)
        if seconds_of is not None:
            fastest[f.stride] = min(fastest.get(f.stride, float("inf")), seconds_of(choice))
        if not (choice.recompute or choice.offload or choice.selective):
            settled.add((f.depth, f.resident))
    if not fits:
        return None, minimum
    if seconds_of is None:
        return min(fits, key=lambda c: (len(c.recompute), -c.prefetch_depth)), minimum
    best = _fastest_per_stride(fits, stride_of, seconds_of)
    if exact_of is None or len(best) == 1:
        return min(best.values(), key=lambda c: (round(seconds_of(c), 9), *_ties(c))), minimum
    return min(best.values(), key=lambda c: (round(exact_of(c), 9), *_ties(c))), minimum


def _ties(c: ScheduleChoice) -> tuple:
    """Predictions equal to the nanosecond are ties (float noise must not pick the schedule): then
    less recompute, less offload, deeper prefetch, fewer residents and selective blocks win."""
    return len(c.recompute), len(c.offload), -c.prefetch_depth, len(c.resident), len(c.selective)


def _fastest_per_stride(fits: list[ScheduleChoice], stride_of: dict[ScheduleChoice, int],
                        seconds_of: Callable[[ScheduleChoice], float]) -> dict[int, ScheduleChoice]:
    """Per stride, its fastest fit by `seconds_of` (the first of equal ones)."""
    best: dict[int, ScheduleChoice] = {}
    for c in fits:
        m = stride_of[c]
        if m not in best or (round(seconds_of(c), 9), *_ties(c)) < (round(seconds_of(best[m]), 9), *_ties(best[m])):
            best[m] = c
    return best


def _exact_fastest(fits: list[ScheduleChoice], seconds_of, exact_of) -> float:
    """The exact seconds of the fastest prefix fit (all of `fits` so far): the ceiling of the
    strided search (infinite without a fit, an estimate or the exact judge)."""
    if not fits or seconds_of is None or exact_of is None:
        return float("inf")
    return exact_of(_fastest_per_stride(fits, dict.fromkeys(fits, 0), seconds_of)[0])
