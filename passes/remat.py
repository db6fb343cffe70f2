"""Recompute: drop a block's saved activations after its forward, rebuild them before its backward.

The recomputed forward replays the random state of the original one (the runtime restores the
generator state recorded at FORWARD), so dropout masks and gradients are unchanged.
"""
from __future__ import annotations

from dataclasses import replace

from megacompile.ir.program import Node, Op, Program, Value, saved


def resaved(s: int) -> str:
    return f"rsaved{s}"


def thrown_away(s: int) -> str:
    return f"xsaved{s}"


def remat(program: Program, recompute: frozenset[int], extra_forwards: int = 0) -> Program:
    """`extra_forwards` > 0 runs that many more forwards, discarded, before each recompute (the
    three-forwards-per-step schedule some systems use; here only to compare against it)."""
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
            if extra_forwards:
                values[thrown_away(s)] = Value(thrown_away(s), tuple(
                    (("x" + k[1:]) if k.startswith(f"f{s}.") else k, b) for k, b in old.parts), "saved")
            for _ in range(extra_forwards):
                nodes.append(Node(Op.RECOMPUTE, s, f.reads, (thrown_away(s),), origin=f.origin,
                                  note="an extra forward, thrown away", transient=f.transient))
                nodes.append(Node(Op.FREE, s, frees=(thrown_away(s),), origin=f.origin))
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
