"""Place the host optimizer: its steps, the gradient clipping before them, and the waits after.

A stage owns the parameters it is the first to use in the forward. A tied parameter (GPT-2's
embedding, reused as the lm head) gets gradients from two stages; its owner's step waits for
both offloads, so the update sees the full gradient.

No update may start before the step is known to be sound: every gradient landed and finite, and
no node of the step failed (docs/decisions.md, "A step either happens completely or not at
all"). So the updates (after CLIP_GRADS when clipping) follow the last gradient offload, in
forward order; the runtime hands them to the host stream when the step commits, and they run
while the next step's forward begins, block 0's first.

With `as_gradients_land` (compile(..., updates="as_gradients_land")) each owner's update is placed
right after the WAIT of the last gradient it needs instead, so the host AdamW runs beside the rest
of the backward. The runtime starts it there, once that owner's gradients are on the host and
finite; a step that fails after an update started cannot be undone (runtime/early_updates.py).
The gradients land in reverse forward order, so a host slower than the backward is left with the
embedding and the first blocks, which the next forward reads first; the planner may move the
updates that start last to the end of the backward, in forward order
(`updates_in_forward_order`, planner/update_order.py chooses how many).

An update may still be running when the step ends; the next step reads a stage's masters only
after a WAIT on them, placed before the stage's first prefetch. Plans that only accumulate
(every micro-batch but the last) have no optimizer nodes, but keep the waits.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import Node, Op, Program, Value, grads, masters


def place_optimizer(program: Program, owner_stages: dict[int, set[int]], readers: dict[int, set[int]],
                    *, update: bool, clip: bool, serial: bool = False, as_gradients_land: bool = False) -> Program:
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
        if as_gradients_land:
            # The settings refuse a finite max_grad_norm with it: a CLIP_GRADS here, after the last
            # gradient, only measures the norm (math.inf), and its scale is 1 whatever it finds.
            for s in sorted(owner_stages):
                after.setdefault(_last_gradient(waited_at, owner_stages[s]), []).append(
                    _step(program, s, "as soon as its gradients have landed"))
            if clip:
                after.setdefault(max(waited_at.values()), []).append(
                    Node(Op.CLIP_GRADS, origin="all gradients", note="the global norm, measured only"))
        else:
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
    updated: set[int] = set()
    for i, n in enumerate(program.nodes):
        if n.op is Op.PREFETCH and program.values[n.writes[0]].kind == "weights":
            if readers[n.stage] & updated:     # only an update placed before its owner's last use
                raise ValueError(f"stage {n.stage}'s weights are fetched after an update of masters "
                                 f"{sorted(readers[n.stage] & updated)} in the same step")
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
                updated.add(m.stage)
    out = program.copy(nodes)
    out.values = values
    return out


def _step(program: Program, s: int, note: str) -> Node:
    return Node(Op.OPTIMIZER_STEP, s, writes=(masters(s),), origin=program.stage_names[s],
                note=f"AdamW on the host fp32 masters, {note}")


def updates_moved_to_landing(program: Program, owner_stages: dict[int, set[int]]) -> Program:
    """The same schedule with each OPTIMIZER_STEP moved to just after the WAIT of the last gradient
    its owner takes: where `as_gradients_land` places it, for timing a plan made with updates at
    commit the other way (a program that clips has no such twin)."""
    if any(n.op is Op.CLIP_GRADS for n in program.nodes):
        raise ValueError("a program that clips gradients cannot update as gradients land")
    steps = {n.stage: n for n in program.nodes if n.op is Op.OPTIMIZER_STEP}
    nodes = [n for n in program.nodes if n.op is not Op.OPTIMIZER_STEP]
    waited = {n.stage: i for i, n in enumerate(nodes) if n.op is Op.WAIT and grads(n.stage) in n.reads}
    after: dict[int, list[Node]] = {}
    for s, node in sorted(steps.items()):
        after.setdefault(_last_gradient(waited, owner_stages[s]), []).append(node)
    out: list[Node] = []
    for i, n in enumerate(nodes):
        out.append(n)
        out += after.get(i, [])
    return program.copy(out)


def updates_in_forward_order(program: Program, tail: int) -> Program:
    """The same schedule with the last `tail` of its updates to start (the owners whose gradients
    land last) moved to where the last of them stands, after every gradient, in forward order: the
    next forward then finds its first blocks' masters updated first, and the updates of the
    blocks it reads last run beside it. Nothing else moves; the updates stay on the host stream in
    program order, so which updates a non-finite gradient leaves applied is still the plan's."""
    steps = [i for i, n in enumerate(program.nodes) if n.op is Op.OPTIMIZER_STEP]
    if tail <= 1 or len(steps) < 2:
        return program
    moved = steps[-tail:]
    nodes = [n for i, n in enumerate(program.nodes) if i not in set(moved[:-1]) and i != moved[-1]]
    at = moved[-1] - (len(moved) - 1)      # where the last of them stood, the others taken out
    tail_nodes = sorted((program.nodes[i] for i in moved), key=lambda n: n.stage)
    tail_nodes = [replace(n, note="AdamW on the host fp32 masters, after the whole backward, in the order the "
                          "next forward reads them") for n in tail_nodes]
    return program.copy(nodes[:at] + tail_nodes + nodes[at:], updates_in_forward_order=len(moved))


def _last_gradient(waited_at: dict[int, int], contributors: set[int]) -> int:
    """The node of the WAIT on the last gradient an owner takes: where its update may start."""
    return max(waited_at[c] for c in contributors)
