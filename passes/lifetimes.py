"""Free every device value right after its last use.

A value may be written more than once (weights are fetched for the forward and again for the
backward); each write starts a new lifetime, ended after its last read. An asynchronous read
(an offload) ends at the WAIT for it, never at the OFFLOAD itself. Values already freed by an
earlier pass (evictions, dropped saved activations) are left as they are.
"""
from __future__ import annotations

from megacompile.ir.program import Node, Op, Program


def lifetimes(program: Program) -> Program:
    nodes = program.nodes
    last_read: dict[str, int] = {}
    live_from: dict[str, int] = {}
    free_after: dict[int, list[str]] = {}

    def close(value: str) -> None:
        start = live_from.pop(value)
        free_after.setdefault(last_read.pop(value, start), []).append(value)

    for i, n in enumerate(nodes):
        if n.op is Op.FREE:
            for v in n.frees:
                live_from.pop(v, None)
                last_read.pop(v, None)
            continue
        for v in n.reads:
            if n.op is not Op.OFFLOAD and v in live_from:
                last_read[v] = i
        for v in n.writes:
            if program.values[v].kind == "host":
                continue      # host masters are not device values
            if v in live_from:
                close(v)
            live_from[v] = i
    for v in list(live_from):
        close(v)
    out: list[Node] = []
    for i, n in enumerate(nodes):
        out.append(n)
        if i in free_after:
            out.append(Node(Op.FREE, frees=tuple(free_after[i]), origin="after last use"))
    return program.copy(out)
