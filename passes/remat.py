"""Recompute: drop a block's saved activations after its forward, rebuild them before its backward.

The recomputed forward replays the random state of the original one (the runtime restores the
generator state recorded at FORWARD), so dropout masks and gradients are unchanged.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import Node, Op, Program, Value, saved


def resaved(s: int) -> str:
    return f"rsaved{s}"


def remat(program: Program, recompute: frozenset[int]) -> Program:
    if not recompute:
        return program
    nodes: list[Node] = []
    values = dict(program.values)
    forwards = {n.stage: n for n in program.nodes if n.op is Op.FORWARD}
    for n in program.nodes:
        if n.op is Op.BACKWARD and n.stage in recompute:
            s = n.stage
            old = values[saved(s)]
            # New storages for what the forward made; aliases of inputs stay aliases.
            parts = tuple((("r" + k[1:]) if k.startswith(f"f{s}.") else k, b) for k, b in old.parts)
            values[resaved(s)] = Value(resaved(s), parts, "saved")
            f = forwards[s]
            nodes.append(Node(Op.RECOMPUTE, s, f.reads, (resaved(s),), origin=f.origin,
                              note=f"keeps {old.nbytes} B of saved activations off the device between passes",
                              transient=f.transient))
            n = replace(n, reads=tuple(resaved(s) if r == saved(s) else r for r in n.reads))
        nodes.append(n)
        if n.op is Op.FORWARD and n.stage in recompute:
            nodes.append(Node(Op.FREE, n.stage, frees=(saved(n.stage),), origin=n.origin,
                              note="recomputed before backward"))
    out = program.copy(nodes, recompute=sorted(recompute))
    out.values = values
    return out
