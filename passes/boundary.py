"""Offload block boundaries: a block's input activation goes to host memory after the block's
forward and comes back before the first node of the backward half that reads it (its recompute,
or its backward).

Saved-value offload and recompute free what a block made, but a block's input (the previous
block's output, batch x seq x hidden: 1.25 GiB at 16 x 4096 x 10240 in bf16) stays on the device
from its forward to its backward, since the backward (and any recompute) reads it. Over 104
blocks that alone is 130 GiB. Sent to host memory, it costs the link its bytes each way, like
any other transfer: the copy out runs beside the next `lag` compute nodes, the copy back is
issued `lag` compute nodes before its first reader.

Only a value that no later forward reads is a boundary (the rotary tables every block reads are
not). A boundary whose copy out would still be running when the copy back must start (the last
blocks before the epilogue) stays on the device: sending it away would free nothing.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import COMPUTE_OPS, Node, Op, Program, Value, restored_of

FORWARD_HALF = (Op.FORWARD, Op.INFER)


def boundary_values(program: Program) -> dict[int, list[str]]:
    """Per stage, the activation inputs of its forward that no other forward reads."""
    readers: dict[str, set[int]] = {}
    for n in program.nodes:
        if n.op in FORWARD_HALF:
            for v in n.reads:
                readers.setdefault(v, set()).add(n.stage)
    return {n.stage: [v for v in n.reads[1:] if program.values[v].kind == "activation" and readers[v] == {n.stage}]
            for n in program.nodes if n.op is Op.FORWARD}


def offload_boundaries(program: Program, blocks: frozenset[int], lag: int = 1) -> Program:
    nodes = program.nodes
    chosen = blocks & {n.stage for n in nodes if n.op is Op.BACKWARD}
    if not chosen:
        return program
    compute_at = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    rank_of = {i: r for r, i in enumerate(compute_at)}
    forward_at = {n.stage: i for i, n in enumerate(nodes) if n.op is Op.FORWARD}
    bounds = {v: s for s, vs in boundary_values(program).items() if s in chosen for v in vs}
    readers: dict[str, list[int]] = {v: [] for v in bounds}    # reads after the forward that sends it
    for i, n in enumerate(nodes):
        for v in n.reads:
            if v in bounds and i > forward_at[bounds[v]]:
                readers[v].append(i)
    values = dict(program.values)
    before: dict[int, list[Node]] = {}
    after: dict[int, list[Node]] = {}
    renamed: dict[int, dict[str, str]] = {}     # node index -> {boundary: its copy from host}
    sent: list[str] = []
    for v, s in bounds.items():
        fwd = forward_at[s]
        if not readers[v]:
            continue
        first = readers[v][0]
        out_done, back_issued = rank_of[fwd] + lag, rank_of[first] - lag
        if out_done >= back_issued:
            continue
        back = restored_of(v)
        values[back] = Value(back, ((back, values[v].nbytes),), "activation")
        origin = nodes[fwd].origin
        after.setdefault(fwd, []).append(Node(Op.OFFLOAD, s, reads=(v,), origin=origin,
                                              note="block input to host memory"))
        after.setdefault(compute_at[out_done], []).extend([Node(Op.WAIT, s, reads=(v,), origin=origin),
                                                           Node(Op.FREE, s, frees=(v,), origin=origin)])
        before.setdefault(compute_at[back_issued], []).append(
            Node(Op.PREFETCH, s, writes=(back,), origin=origin, note="block input back from host memory"))
        before.setdefault(first, []).append(Node(Op.WAIT, s, reads=(back,), origin=origin))
        for i in readers[v]:
            renamed.setdefault(i, {})[v] = back
        sent.append(v)
    if not sent:
        return program
    out: list[Node] = []
    for i, n in enumerate(nodes):
        out.extend(before.get(i, []))
        if i in renamed:
            n = replace(n, reads=tuple(renamed[i].get(r, r) for r in n.reads))
        out.append(n)
        out.extend(after.get(i, []))
    result = program.copy(out, boundary=sorted(chosen), boundary_values=sent)
    result.values = values
    return result
