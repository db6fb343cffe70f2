"""The summary's block lines: a pattern the solver repeats (one block in four recomputed, three
offloaded) prints once per decision with its share, not once per group (plan_blocks.periodic)."""
from __future__ import annotations

from megacompile.planner.plan_blocks import periodic


def _groups(pattern: list[tuple[str, int]], repeats: int, tail: list[tuple[str, int]] = ()) -> list[list[dict]]:
    groups, b = [], 0
    for hold, n in pattern * repeats + list(tail):
        groups.append([{"stage": f"block.{b + k}", "hold": hold, "selective": False, "template": 0,
                        "saved_bytes": 1, "input_to_host_bytes": 0} for k in range(n)])
        b += n
    return groups


def test_a_repeated_pattern_prints_once_per_decision_with_its_share():
    folded = periodic(_groups([("recompute", 1), ("offload", 3)], 20))
    assert [(g[0]["hold"], span) for g, span in folded] == [
        ("recompute", "block.0..block.76, 1 of every 4 (20 blocks)"),
        ("offload", "block.1..block.79, 3 of every 4 (60 blocks)")]


def test_what_does_not_repeat_enough_prints_as_it_is_and_a_tail_after_the_pattern_too():
    groups = _groups([("offload", 2), ("recompute", 1)], 4, tail=[("keep", 5)])
    spans = [span for _, span in periodic(groups)]
    assert spans == ["block.0..block.10, 2 of every 3 (8 blocks)", "block.2..block.11, 1 of every 3 (4 blocks)",
                     "block.12..block.16"]
    short = _groups([("offload", 2), ("recompute", 1)], 2)
    assert [span for _, span in periodic(short)] == ["block.0..block.1", "block.2", "block.3..block.4", "block.5"]
