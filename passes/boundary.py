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


def boundary_values(program: Program, stage: int) -> list[str]:
    """The activation inputs of `stage`'s forward that no other forward reads."""
    forward = next((n for n in program.nodes if n.op is Op.FORWARD and n.stage == stage), None)
    if forward is None:
        return []
    others = {v for n in program.nodes if n.op in FORWARD_HALF and n.stage != stage for v in n.reads}
    return [v for v in forward.reads[1:]
            if program.values[v].kind == "activation" and v not in others]


def offload_boundaries(program: Program, blocks: frozenset[int], lag: int = 1) -> Program:
    nodes = program.nodes
    has_backward = {n.stage for n in nodes if n.op is Op.BACKWARD}
    compute_at = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    rank_of = {i: r for r, i in enumerate(compute_at)}
    values = dict(program.values)
    before: dict[int, list[Node]] = {}
    after: dict[int, list[Node]] = {}
    renamed: dict[int, dict[str, str]] = {}     # node index -> {boundary: its copy from host}
    sent: list[str] = []
    for s in sorted(blocks & has_backward):
        fwd = next(i for i, n in enumerate(nodes) if n.op is Op.FORWARD and n.stage == s)
        for v in boundary_values(program, s):
            readers = [i for i, n in enumerate(nodes) if i > fwd and v in n.reads]
            if not readers:
                continue
            first = readers[0]
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
            for i in readers:
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
    result = program.copy(out, boundary=sorted(blocks & has_backward), boundary_values=sent)
    result.values = values
    return result
