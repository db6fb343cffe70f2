"""Offload saved activations: send a block's saved values to host memory after its forward and
bring them back before its backward, instead of keeping them on the device or recomputing them.

The copy out starts right after the forward and is waited for `lag` compute nodes later, so it
runs beside the next blocks' forwards (the device memory is released only when the copy is
done); the copy back is issued `lag` compute nodes before the backward that reads it. The planner
sets `lag` from the cost model: the copy's time over a block's compute time. Both ride the same links as the weights and the gradients, which is why the solver
weighs this against recompute with the cost model rather than choosing it by habit.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import COMPUTE_OPS, Node, Op, Program, restored, saved


def offload_saved(program: Program, offload: frozenset[int], lag: int = 1) -> Program:
    nodes = program.nodes
    # A stage with no backward (frozen, nothing before it trains) saves nothing to send.
    offload = offload & {n.stage for n in nodes if n.op is Op.BACKWARD}
    if not offload:
        return program
    compute_at = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    rank_of = {i: r for r, i in enumerate(compute_at)}
    # A block whose backward comes within `lag` compute nodes of its forward (the last ones) keeps
    # its saved values: the copy out could not be waited for before the backward reads them.
    ranks = {(n.op, n.stage): rank_of[i] for i, n in enumerate(nodes) if n.op in (Op.FORWARD, Op.BACKWARD)}
    offload = frozenset(s for s in offload if ranks[(Op.FORWARD, s)] + lag < ranks[(Op.BACKWARD, s)])
    if not offload:
        return program
    before: dict[int, list[Node]] = {}
    after: dict[int, list[Node]] = {}
    sent: dict[int, int] = {}      # stage -> the node after which its copy out is waited for
    for i, n in enumerate(nodes):
        if n.stage not in offload:
            continue
        s = n.stage
        if n.op is Op.FORWARD:
            out = Node(Op.OFFLOAD, s, reads=(saved(s),), origin=n.origin, note="saved activations to host memory")
            nxt = compute_at[min(rank_of[i] + lag, len(compute_at) - 1)]
            after.setdefault(i, []).append(out)
            sent[s] = nxt
            after.setdefault(nxt, []).extend([Node(Op.WAIT, s, reads=(saved(s),), origin=n.origin),
                                              Node(Op.FREE, s, frees=(saved(s),), origin=n.origin)])
        elif n.op is Op.BACKWARD:
            issue = compute_at[max(rank_of[i] - lag, 0)]
            back = Node(Op.PREFETCH, s, writes=(restored(s),), origin=n.origin,
                        note="saved activations back from host memory")
            if issue <= sent.get(s, -1):
                # A block this close to its backward (the last ones, with a long lag): the copy
                # back may start only once the copy out is done.
                after[sent[s]].append(back)
            else:
                before.setdefault(issue, []).append(back)
            before.setdefault(i, []).append(Node(Op.WAIT, s, reads=(restored(s),), origin=n.origin))
    out: list[Node] = []
    for i, n in enumerate(nodes):
        out.extend(before.get(i, []))
        if n.op is Op.BACKWARD and n.stage in offload:
            n = replace(n, reads=tuple(restored(n.stage) if r == saved(n.stage) else r for r in n.reads))
        out.append(n)
        out.extend(after.get(i, []))
    return program.copy(out, offload=sorted(offload))
