"""Judge a choice for a deep stack on a short one: the solver's cost follows the runs, not the depth.

A candidate holds its blocks in runs: the first j offloaded, the next k recomputed, the rest kept,
each run on one template, selective or not, its input in host memory or not. Inside a run every
block does the same thing at the same distance from its neighbours. Once a run is longer than
the copies that overlap its computes (an activation copy spans `lag` compute nodes, a weight
prefetch `depth`), one block more in the run's middle adds, to every node from the forward of
the block after it to that block's backward, the bytes one block of the run holds across that
span; and to the step, one block's share of it (its period). So the solver simulates the stack
with each run cut to `keep` blocks at each end, and adds the cut blocks back as bytes per node
and seconds per block.

A run may also repeat a short pattern of holds (every m-th block recomputed, the others
offloaded: solve.py's `stride`): then whole periods of the pattern are cut, and each adds the
bytes and the busiest stream's seconds of one period.

The cut blocks are the middle of each run: `keep` blocks stay at each end, so every remaining
block has neighbours that do what its cut neighbours did, on both sides of the cut, in the
forward and in the backward. The last block before the cut feeds the first one after it; only an
output with the same shape, dtype and gradient may stand in (otherwise that run is left whole).
The chosen schedule is always built, simulated, verified and timed on the whole stack; only the
search uses the short one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megacompile.capture import CapturedModel, Port
from megacompile.ir.program import Op, Program

from ..passes.pipeline import ScheduleChoice


@dataclass(frozen=True)
class Run:
    """Blocks cut from one run: `removed` of them, and in the short stack `first`, the stage of
    the first block after the cut (its forward and backward bound the span they held bytes over)."""
    first: int
    removed: int
    key: tuple         # what each block of its period does: (template, hold, selective, boundary) each
    period: int = 1    # blocks in the pattern the run repeats; `removed` is a multiple of it


@dataclass(frozen=True)
class Short:
    captured: CapturedModel
    choice: ScheduleChoice
    runs: tuple[Run, ...]


def _hold(s: int, choice: ScheduleChoice) -> tuple:
    hold = "offload" if s in choice.offload else "recompute" if s in choice.recompute else "keep"
    return hold, s in choice.selective, s in choice.boundary


def _same_output(captured: CapturedModel, a: int, b: int, k: int) -> bool:
    oa, ob = captured.stages[a].template.outputs, captured.stages[b].template.outputs
    return (k < len(oa) and k < len(ob) and (oa[k].shape, oa[k].dtype, oa[k].requires_grad)
            == (ob[k].shape, ob[k].dtype, ob[k].requires_grad))


def shorten(captured: CapturedModel, blocks: list[int], choice: ScheduleChoice, keep: int) -> Short:
    """`captured` with each run of like blocks longer than 2 x `keep` cut to `keep` blocks at each
    end, the choice for the short stack, and what was cut."""
    runs = _runs(captured, blocks, choice, keep)
    read_by: dict[int, list[tuple[int, int]]] = {}
    for c, st in enumerate(captured.stages):
        for p in st.inputs:
            read_by.setdefault(p.stage, []).append((c, p.index))
    cut: set[int] = set()
    stand_in: dict[int, int] = {}     # a cut stage -> the stage whose outputs its readers now read
    cuts: list[tuple[list[int], int]] = []
    for run, period in runs:
        ends = _ends(keep, period)
        n = (len(run) - 2 * ends) // period * period
        if n <= 0:
            continue
        gone, before, after = run[ends:ends + n], run[ends - 1], run[ends + n]
        readers = [(c, b, k) for b in gone for c, k in read_by.get(b, ())]
        # A chain: each cut block is read only by the next block of its run, and the last block
        # before the cut can stand in for the last cut one.
        if any(c != b + 1 or (b == gone[-1] and not _same_output(captured, before, b, k)) for c, b, k in readers) \
                or any(p.stage in gone for p in captured.outputs):
            continue
        cut.update(gone)
        stand_in[gone[-1]] = before
        cuts.append((after, n, period))
    if not cut:
        return Short(captured, choice, ())
    new = {s: i for i, s in enumerate(s for s in range(len(captured.stages)) if s not in cut)}

    def port(p: Port) -> Port:
        return p if p.stage < 0 else Port(new[stand_in.get(p.stage, p.stage)], p.index)
    stages = [dataclasses.replace(st, inputs=[port(p) for p in st.inputs])
              for s, st in enumerate(captured.stages) if s not in cut]
    short = dataclasses.replace(captured, stages=stages, outputs=[port(p) for p in captured.outputs])

    runs_cut = tuple(Run(new[after], n, tuple((id(captured.stages[s].template), *_hold(s, choice))
                                              for s in range(after, after + period)), period)
                     for after, n, period in cuts)

    def renumber(chosen: frozenset[int]) -> frozenset[int]:
        return frozenset(new[s] for s in chosen if s not in cut)
    choice = dataclasses.replace(choice, recompute=renumber(choice.recompute), resident=renumber(choice.resident),
                                 offload=renumber(choice.offload), selective=renumber(choice.selective),
                                 boundary=renumber(choice.boundary))
    return Short(short, choice, runs_cut)


# The longest pattern of holds a run may repeat (solve.py's strides go up to it).
PERIODS = 4


def _runs(captured: CapturedModel, blocks: list[int], choice: ScheduleChoice, keep: int
          ) -> list[tuple[list[int], int]]:
    """The blocks in runs, each with its period: from each block, the period (1 to PERIODS) whose
    repeats from there let the most blocks be cut, the shortest on a tie. A longer period counts
    only where its blocks differ in how they are held, so a stack whose blocks alternate templates
    but are held alike is cut as it always was."""
    keys = [(id(captured.stages[s].template), *_hold(s, choice)) for s in blocks]
    out: list[tuple[list[int], int]] = []
    i = 0
    while i < len(blocks):
        best, best_cut = (1, 1), 0
        for p in range(1, PERIODS + 1):
            t = i + 1
            while t < len(blocks) and blocks[t] == blocks[t - 1] + 1 and (t - i < p or keys[t] == keys[t - p]):
                t += 1
            if p > 1 and len({k[1:] for k in keys[i:i + p]}) < 2:
                continue
            length = t - i if p == 1 else (t - i) // p * p
            ends = _ends(keep, p)
            cut = max(0, (length - 2 * ends) // p * p)
            if p == 1:
                best = (length, 1)
            if cut > best_cut:
                best, best_cut = (length, p), cut
        length, p = best
        out.append((blocks[i:i + length], p))
        i += length
    return out


def _ends(keep: int, period: int) -> int:
    """Blocks left at each end of a run: whole periods, so many that every block of the period
    after the cut is `keep` blocks from the run's end (its bytes then stand for a cut period's)."""
    return -(-(keep + period - 1) // period) * period


def held_bytes(program: Program, upto: int, prefix: str, exact: str | None = None,
               live: dict[str, int] | None = None) -> int:
    """Bytes of the storages whose key starts with `prefix`, or is `exact`, that are live just before
    node `upto` (the ledger's rule: a storage lives while any value holds it). `live`:
    live_bytes(program, upto), when already known (one walk serves every prefix)."""
    live = live_bytes(program, upto) if live is None else live
    return sum(nbytes for k, nbytes in live.items() if k.startswith(prefix) or k == exact)


def live_bytes(program: Program, upto: int) -> dict[str, int]:
    """The storages live just before node `upto`, by key, and their bytes."""
    holders: dict[str, set[str]] = {}
    size: dict[str, int] = {}
    for n in program.nodes[:upto]:
        if n.op is Op.FREE:
            for v in n.frees:
                for key, _ in program.values[v].parts:
                    if key in holders:
                        holders[key].discard(v)
                        if not holders[key]:
                            del holders[key]
        else:
            for v in n.writes:
                for key, nbytes in program.values[v].parts:
                    holders.setdefault(key, set()).add(v)
                    size[key] = nbytes
    return {k: size[k] for k in holders}


def span(program: Program, stage: int) -> tuple[int, int]:
    """Node indices of `stage`'s first forward and of its last backward (with layer-major
    accumulation a stage runs once per micro-batch in each pass). A stage with no backward (a frozen
    vision tower ahead of everything trained) spans its forwards."""
    at = [(n.op, i) for i, n in enumerate(program.nodes) if n.stage == stage and n.op in (Op.FORWARD, Op.BACKWARD)]
    backward = [i for op, i in at if op is Op.BACKWARD]
    return (min(i for op, i in at if op is Op.FORWARD), max(backward or [i for _, i in at]))


def peak_with_cut(peak_during: list[int], added: list[tuple[int, int, int]]) -> int:
    """The whole stack's peak from the short stack's curve: `added` holds, per run that lost
    blocks, (the forward of the block after the cut, that block's backward, the bytes the cut
    blocks hold over that span: each what one block of its run holds when the backward begins)."""
    steps = [0] * (len(peak_during) + 1)
    for first, last, extra in added:
        steps[first] += extra
        steps[last + 1] -= extra
    peak, running = 0, 0
    for i, during in enumerate(peak_during):
        running += steps[i]
        peak = max(peak, during + running)
    return peak
