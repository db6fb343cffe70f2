"""Passes and the solver: what each adds, and that the choice is monotone in the budget."""
from __future__ import annotations


from megacompile.ir.program import Op
from megacompile.ir.simulate import simulate
from megacompile.passes import ScheduleChoice, build_schedule
from megacompile.planner.solve import solve
from tests import models


def _captured(layers=4):
    return models.captured_llama(layers=layers, d=64, rows=2, seq=16)


def _blocks(captured):
    return [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]


def test_weights_cross_the_link_at_most_twice_per_step():
    captured = _captured()
    program = build_schedule(captured, ScheduleChoice(1, frozenset(_blocks(captured))))
    fetches = [n.stage for n in program.nodes if n.op is Op.PREFETCH]
    for s in range(len(captured.stages)):
        assert 1 <= fetches.count(s) <= 2
    # the epilogue runs forward then backward back to back: one fetch serves both
    assert fetches.count(len(captured.stages) - 1) == 1


def test_prefetch_depth_one_issues_each_fetch_before_the_previous_compute():
    captured = _captured()
    program = build_schedule(captured, ScheduleChoice(1))
    nodes = program.nodes
    for i, n in enumerate(nodes):
        if n.op is Op.PREFETCH and n.stage > 0 and n.stage < len(captured.stages) - 1:
            following = next(m for m in nodes[i:] if m.op in (Op.FORWARD, Op.BACKWARD, Op.RECOMPUTE))
            assert following.stage != n.stage, "a depth-1 prefetch must overlap another stage's compute"


def test_recompute_lowers_the_peak_and_adds_one_forward_per_block():
    captured = _captured()
    blocks = _blocks(captured)
    keep = build_schedule(captured, ScheduleChoice(1))
    again = build_schedule(captured, ScheduleChoice(1, frozenset(blocks)))
    assert sum(n.op is Op.RECOMPUTE for n in again.nodes) == len(blocks)
    assert simulate(again).peak < simulate(keep).peak


def test_solver_is_monotone_in_the_budget():
    captured = _captured(layers=6)
    blocks = _blocks(captured)

    def peak_of(choice):
        return simulate(build_schedule(captured, choice, check=False)).peak

    lowest = peak_of(ScheduleChoice(0, frozenset(blocks)))
    highest = peak_of(ScheduleChoice(1))
    assert solve(blocks, lowest - 1, peak_of)[0] is None
    previous = None
    for budget in range(lowest, highest + 2, max(1, (highest - lowest) // 25)):
        choice, _ = solve(blocks, budget, peak_of)
        assert choice is not None and peak_of(choice) <= budget
        rank = (1 - choice.prefetch_depth, len(choice.recompute))   # lower is faster
        if previous is not None:
            assert rank <= previous, "more budget gave a slower choice"
        previous = rank
    assert solve(blocks, highest, peak_of)[0] == ScheduleChoice(1)


def test_solver_finds_the_fastest_fitting_choice_of_its_whole_search_space():
    """Bisection within a family and skipping dominated families lose nothing: the choice is as
    fast as the fastest of every candidate, each one built and timed."""
    from megacompile.cost import get_profile, predict
    from megacompile.passes.selective import with_selective
    from megacompile.planner.solve import candidates
    from megacompile.planner.search import search_space

    captured = _captured(layers=3)
    blocks = _blocks(captured)
    hardware = get_profile("h100")
    built = {}

    def schedule(choice):
        if choice not in built:
            built[choice] = build_schedule(captured, choice, check=False)
        return built[choice]

    def peak_of(choice):
        return simulate(schedule(choice)).peak

    def seconds_of(choice):
        return predict(schedule(choice), with_selective(captured, choice.selective), hardware).step_s

    space = search_space(captured, blocks, hardware)
    assert any(f.selective.value != "none" for f in space) and any(f.offloaded for f in space)
    everything = {c for f in space for c in candidates(blocks, f)}
    peaks = sorted({peak_of(c) for c in everything})
    for budget in peaks[:: max(1, len(peaks) // 6)] + [peaks[-1]]:
        choice, _ = solve(blocks, budget, peak_of, seconds_of, space)
        best = min(seconds_of(c) for c in everything if peak_of(c) <= budget)
        assert peak_of(choice) <= budget
        assert seconds_of(choice) <= best + 1e-9, (budget, choice)    # ties are to the nanosecond


def test_below_the_lowest_peak_nothing_is_searched_and_nothing_would_fit():
    """solve() refuses a budget under its smallest peak (every block recomputed) before it searches
    a family: that is safe because no candidate of the whole search space holds less."""
    from megacompile.cost import get_profile
    from megacompile.planner.search import search_space
    from megacompile.planner.solve import candidates, lowest

    captured = _captured(layers=3)
    blocks = _blocks(captured)
    space = search_space(captured, blocks, get_profile("h100"))
    judged = []

    def peak_of(choice):
        judged.append(choice)
        return simulate(build_schedule(captured, choice, check=False)).peak

    least = peak_of(lowest(blocks, space, peak_of))
    everything = {c for f in space for c in candidates(blocks, f)}
    assert min(peak_of(c) for c in everything) == least
    judged.clear()
    assert solve(blocks, least - 1, peak_of, None, space) == (None, least)
    assert 0 < len(judged) <= len(space) + 1 < len(everything)      # the lowest's candidates, and its peak
    assert all(c.recompute == frozenset(blocks) for c in judged)


def test_selective_saving_lowers_the_peak_of_every_way_to_hold_a_block():
    captured = _captured()
    blocks = frozenset(_blocks(captured))
    for recompute, offload in ((frozenset(), frozenset()), (blocks, frozenset()), (frozenset(), blocks)):
        peaks = [simulate(build_schedule(captured, ScheduleChoice(0, recompute, offload=offload, selective=sel))).peak
                 for sel in (frozenset(), blocks)]
        assert peaks[1] < peaks[0], (recompute, offload)
