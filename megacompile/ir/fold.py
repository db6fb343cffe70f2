"""Runs of blocks that do the same thing, found in a schedule so the printer can fold them.

A run is a window of `period` nodes repeated `count` times back to back, each repeat the window
before it with every stage number moved by `shift` (+1 in the forward, -1 in the backward): the
same ops, the same value names but for the stage number (x0.2, a prologue output every block
reads, stays as it is), the same bytes, and origins that differ only by that number
(model.layers.3 -> model.layers.4). Found greedily from the top: at each node the period and
direction covering the most nodes wins, the shortest period on a tie.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .program import COMPUTE_OPS, Node, Program

LONGEST_PERIOD = 64
FEWEST_REPEATS = 4       # first and last shown whole, at least two folded between them
_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Run:
    start: int       # first node of the first window
    period: int      # nodes per window
    count: int       # windows
    shift: int       # stage numbers move by this from one window to the next

    @property
    def end(self) -> int:
        return self.start + self.period * self.count


def _split(text: str) -> list[str]:
    return _NUMBER.split(text)


def _same_but_shifted(a: list[str], b: list[str], shift: int) -> bool:
    """Strings split at their numbers: equal text, each number equal or moved by `shift`."""
    if len(a) != len(b):
        return False
    for k, (x, y) in enumerate(zip(a, b)):
        if k % 2 == 0:
            if x != y:
                return False
        elif x != y and int(y) - int(x) != shift:
            return False
    return True


class _Shapes:
    """Per node what must agree exactly (op, text without numbers, bytes) and its split strings."""

    def __init__(self, program: Program):
        self.key, self.parts = [], []
        for n in program.nodes:
            names = n.reads + ("->",) + n.writes + ("|",) + n.frees
            split = [_split(v) for v in names] + [_split(n.origin), _split(n.note)]
            sizes = tuple(program.values[v].nbytes for v in n.reads + n.writes + n.frees)
            key = (n.op, n.stage is None, n.transient, sizes, tuple(tuple(s[0::2]) for s in split))
            self.key.append(key)
            self.parts.append(split)

    def same(self, program: Program, i: int, j: int, shift: int) -> bool:
        if self.key[i] != self.key[j]:
            return False
        a, b = program.nodes[i], program.nodes[j]
        if a.stage is not None and b.stage - a.stage != shift:
            return False
        return all(_same_but_shifted(x, y, shift) for x, y in zip(self.parts[i], self.parts[j]))


def find_runs(program: Program) -> list[Run]:
    n = len(program.nodes)
    shapes = _Shapes(program)
    # streak[(p, d)][i]: how many nodes from i on match the node p later, shifted by d
    streak: dict[tuple[int, int], list[int]] = {}
    for p in range(1, min(LONGEST_PERIOD, n // FEWEST_REPEATS) + 1):
        for d in (1, -1):
            s = [0] * (n + 1)
            for i in range(n - p - 1, -1, -1):
                s[i] = s[i + 1] + 1 if shapes.same(program, i, i + p, d) else 0
            streak[(p, d)] = s
    runs, i = [], 0
    while i < n:
        best = None
        for (p, d), s in streak.items():
            count = s[i] // p + 1
            if count >= FEWEST_REPEATS and (best is None or count * p > best.count * best.period):
                best = Run(i, p, count, d)
        if best is None:
            i += 1
            continue
        runs.append(best)
        i = best.end
    return runs


def window_label(program: Program, run: Run, k: int) -> str:
    """The stage a window is about: that of its first compute node, else of its first staged node."""
    nodes: list[Node] = program.nodes[run.start + k * run.period: run.start + (k + 1) * run.period]
    staged = [n for n in nodes if n.op in COMPUTE_OPS] or [n for n in nodes if n.stage is not None]
    return program.stage_names[staged[0].stage] if staged else f"window {k}"
