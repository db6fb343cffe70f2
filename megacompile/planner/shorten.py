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
    key: tuple         # what each block of it does: (template, hold, selective, boundary)


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
    runs: list[list[int]] = []
    for s in blocks:
        key = (id(captured.stages[s].template), *_hold(s, choice))
        if runs and runs[-1][-1] == s - 1 and (id(captured.stages[s - 1].template), *_hold(s - 1, choice)) == key:
            runs[-1].append(s)
        else:
            runs.append([s])
    read_by: dict[int, list[tuple[int, int]]] = {}
    for c, st in enumerate(captured.stages):
        for p in st.inputs:
            read_by.setdefault(p.stage, []).append((c, p.index))
    cut: set[int] = set()
    stand_in: dict[int, int] = {}     # a cut stage -> the stage whose outputs its readers now read
    cuts: list[tuple[list[int], int]] = []
    for run in runs:
        n = len(run) - 2 * keep
        if n <= 0:
            continue
        gone, before, after = run[keep:keep + n], run[keep - 1], run[keep + n]
        readers = [(c, b, k) for b in gone for c, k in read_by.get(b, ())]
        # A chain: each cut block is read only by the next block of its run, and the last block
        # before the cut can stand in for the last cut one.
        if any(c != b + 1 or (b == gone[-1] and not _same_output(captured, before, b, k)) for c, b, k in readers) \
                or any(p.stage in gone for p in captured.outputs):
            continue
        cut.update(gone)
        stand_in[gone[-1]] = before
        cuts.append((after, n))
    if not cut:
        return Short(captured, choice, ())
    new = {s: i for i, s in enumerate(s for s in range(len(captured.stages)) if s not in cut)}

    def port(p: Port) -> Port:
        return p if p.stage < 0 else Port(new[stand_in.get(p.stage, p.stage)], p.index)
    stages = [dataclasses.replace(st, inputs=[port(p) for p in st.inputs])
              for s, st in enumerate(captured.stages) if s not in cut]
    short = dataclasses.replace(captured, stages=stages, outputs=[port(p) for p in captured.outputs])

    runs_cut = tuple(Run(new[after], n, (id(captured.stages[after].template), *_hold(after, choice)))
                     for after, n in cuts)

    def renumber(chosen: frozenset[int]) -> frozenset[int]:
        return frozenset(new[s] for s in chosen if s not in cut)
    choice = dataclasses.replace(choice, recompute=renumber(choice.recompute), resident=renumber(choice.resident),
                                 offload=renumber(choice.offload), selective=renumber(choice.selective),
                                 boundary=renumber(choice.boundary))
    return Short(short, choice, runs_cut)


def held_bytes(program: Program, upto: int, prefix: str) -> int:
    """Bytes of the storages whose key starts with `prefix` that are live just before node `upto`
    (the ledger's rule: a storage lives while any value holds it)."""
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
    return sum(size[k] for k in holders if k.startswith(prefix))


def span(program: Program, stage: int) -> tuple[int, int]:
    """Node indices of `stage`'s first forward and of its last backward (with layer-major
    accumulation a stage runs once per micro-batch in each pass)."""
    at = [(n.op, i) for i, n in enumerate(program.nodes) if n.stage == stage and n.op in (Op.FORWARD, Op.BACKWARD)]
    return (min(i for op, i in at if op is Op.FORWARD), max(i for op, i in at if op is Op.BACKWARD))


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
