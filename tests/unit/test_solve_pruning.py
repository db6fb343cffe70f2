"""The solver skips most families without a schedule built (planner/solve.py): a pair settled or
outrun by its choice with every block kept whole, a depth whose every-block-recomputed choices do
not fit, a floor above the bar or, for strided families, above the fastest prefix fit's exact
seconds. None of that may change the choice: at every budget from the smallest to a roomy one,
the pruned search returns what the search of every family, each bisected in full, returns."""
from __future__ import annotations

import pytest

from megacompile.cost import get_profile, predict
from megacompile.passes import StepKind, build_schedule
from megacompile.passes.lower import lower
from megacompile.passes.selective import with_selective
from megacompile.planner.floor import compute_floor
from megacompile.planner.search import judges, search_space
from megacompile.planner.solve import _fastest_per_stride, _ties, candidates, smallest_fit, solve
from tests import models


def exhaustive(blocks, budget, peak_of, seconds_of, options, exact_of):
    """Every family bisected, then the fastest of each stride by the estimate, then by the exact."""
    fits, stride_of = [], {}
    for f in options:
        choice = smallest_fit(candidates(blocks, f), budget, peak_of)
        if choice is not None:
            fits.append(choice)
            stride_of.setdefault(choice, f.stride)
    if not fits:
        return None
    best = _fastest_per_stride(fits, stride_of, seconds_of)
    return min(best.values(), key=lambda c: (round(exact_of(c), 9), *_ties(c)))


@pytest.mark.parametrize("profile", ["h100", pytest.param("rtx4090", marks=pytest.mark.slow)])
def test_the_pruned_search_chooses_what_the_exhaustive_one_does(profile):
    captured = models.captured_llama(layers=6, d=64, rows=4, seq=64)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    hardware = get_profile(profile)
    built = {}

    def schedule(choice):
        if choice not in built:
            built[choice] = build_schedule(captured, choice, check=False)
        return built[choice]
    peak_of, seconds_of = judges(captured, blocks, hardware, schedule, lower, StepKind())

    def exact_of(choice):
        return predict(schedule(choice), with_selective(captured, choice.selective), hardware).step_s
    floor_of = compute_floor(captured, hardware)
    weights = sum(st.template.weight_bytes for st in captured.stages)
    _, least = solve(blocks, 0, peak_of, seconds_of, search_space(captured, blocks, hardware, device_room=0))
    chosen = set()
    for budget in [int(least * x) for x in (0.95, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)] + [4 * weights]:
        space = search_space(captured, blocks, hardware, device_room=budget)
        pruned, _ = solve(blocks, budget, peak_of, seconds_of, space, exact_of, floor_of=floor_of)
        assert pruned == exhaustive(blocks, budget, peak_of, seconds_of, space, exact_of), budget
        chosen.add(pruned)
    # Nothing fits below the smallest peak, and the choices differ over the rest of the budgets.
    assert None in chosen and len(chosen) >= 5
