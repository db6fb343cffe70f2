"""Place the host optimizer: its steps, the gradient clipping before them, and the waits after.

A stage owns the parameters it is the first to use in the forward. A tied parameter (GPT-2's
embedding, reused as the lm head) gets gradients from two stages; its owner's step waits for
both offloads, so the update sees the full gradient.

No update may start before the step is known to be sound: every gradient landed and finite, and
no node of the step failed (docs/decisions.md, "A step either happens completely or not at
all"). So the updates (after CLIP_GRADS when clipping) follow the last gradient offload, in
forward order; the runtime hands them to the host stream when the step commits, and they run
while the next step's forward begins, block 0's first.

An update may still be running when the step ends; the next step reads a stage's masters only
after a WAIT on them, placed before the stage's first prefetch. Plans that only accumulate
(every micro-batch but the last) have no optimizer nodes, but keep the waits.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import Node, Op, Program, Value, grads, masters


def place_optimizer(program: Program, owner_stages: dict[int, set[int]], readers: dict[int, set[int]],
                    *, update: bool, clip: bool, serial: bool = False) -> Program:
    """`owner_stages[s]`: stages whose gradients touch masters stage s owns;
    `readers[s]`: owners whose masters stage s's weights are copied from."""
    values = dict(program.values)
    for s in owner_stages:
        values[masters(s)] = Value(masters(s), (), "host")
    waited_at: dict[int, int] = {}
    for i, n in enumerate(program.nodes):
        if n.op is Op.WAIT and grads(n.stage) in n.reads:
            waited_at[n.stage] = i
    after: dict[int, list[Node]] = {}
    if update:
        for s, contributors in owner_stages.items():
            missing = [c for c in contributors if c not in waited_at]
            if missing:
                raise ValueError(f"stage {s}'s gradients from stages {missing} are never offloaded")
        last = max(waited_at.values())
        after[last] = [Node(Op.CLIP_GRADS, origin="all gradients",
                            note="global norm, then one scale for every update")] if clip else []
        after[last] += [_step(program, s, "once the step is known finite") for s in sorted(owner_stages)]
    # Before each prefetch, wait for the masters it copies unless already waited for since
    # their last update.
    fresh: set[int] = set()
    nodes: list[Node] = []
    if serial:   # nothing of the next step starts before every update is done
        for owner in sorted(owner_stages):
            nodes.append(Node(Op.WAIT, owner, reads=(masters(owner),), origin=program.stage_names[owner],
                              note="serial optimizer: all updates first"))
            fresh.add(owner)
    for i, n in enumerate(program.nodes):
        if n.op is Op.PREFETCH and program.values[n.writes[0]].kind == "weights":
            for owner in sorted(readers[n.stage] - fresh):
                nodes.append(Node(Op.WAIT, owner, reads=(masters(owner),), origin=program.stage_names[owner],
                                  note="the last update of these masters"))
                fresh.add(owner)
            n = replace(n, reads=tuple(masters(o) for o in sorted(readers[n.stage])))
        nodes.append(n)
        for m in after.get(i, []):
            nodes.append(m)
            if m.op is Op.OPTIMIZER_STEP:
                fresh.discard(m.stage)
    out = program.copy(nodes)
    out.values = values
    return out


def _step(program: Program, s: int, note: str) -> Node:
    return Node(Op.OPTIMIZER_STEP, s, writes=(masters(s),), origin=program.stage_names[s],
                note=f"AdamW on the host fp32 masters, {note}")
