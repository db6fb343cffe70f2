"""Straight-line Python for a stage graph: the interpreter's walk, without the walking.

StageProgram.run interprets a graph op by op: per op it maps the arguments through a dict,
zips the drop lists and calls two hooks. That is 10-20 us of Python per op, enough to starve a
GPU on blocks of a few hundred ops at small batches. This writes the same walk out as one
function, with every value in a local variable:

    def run(inputs, on_alloc, on_free):
        x, w = inputs
        v2 = T2(x, C2, w)                 # the op, its constants bound once
        on_alloc(N2, v2)
        on_free(N1, v1); del v1            # the values whose last reader this op was
        ...
        return [v7, v9]

The order of ops, allocations and drops is the interpreter's, so the ledger sees the same peaks.
A graph whose arguments hold a node inside a container the generator does not know (anything
but lists and tuples) is left to the interpreter (`generate` returns None).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from .stage_ops import runnable


class _Unsupported(Exception):
    pass


def generate(program, placed: bool = False) -> Callable | None:
    """The generated `run(inputs, on_alloc, on_free)` of a StageProgram (read for its
    placeholders, body, free_after, output_node and gm), or None. `placed`: it takes a fourth
    argument, one entry per op, a callable that runs in the op's stead where not None (the device
    arena's placements, runtime/placement.py):  v2 = (P[2] or T2)(x, C2, w)."""
    names: dict[fx.Node, str] = {}
    scope: dict[str, Any] = {}

    def bind(value: Any, prefix: str) -> str:
        key = f"{prefix}{len(scope)}"
        scope[key] = value
        return key

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)) and _holds_node(a):
            items = ", ".join(arg(x) for x in a)
            return f"[{items}]" if isinstance(a, list) else f"({items}{',' if len(a) == 1 else ''})"
        if _holds_node(a):
            raise _Unsupported(type(a).__name__)
        return bind(a, "C")

    lines = []
    for i, p in enumerate(program.placeholders):
        names[p] = f"i{i}"
    if names:
        lines.append(f"    {', '.join(names[p] for p in program.placeholders)}, = inputs[:{len(names)}]")
    try:
        for i, (node, frees) in enumerate(zip(program.body, program.free_after)):
            var = names[node] = f"v{i}"
            if node.op == "get_attr":
                lines.append(f"    {var} = getattr({bind(program.gm, 'G')}, {node.target!r})")
            else:
                call = [arg(a) for a in node.args] + [f"{k}={arg(v)}" for k, v in node.kwargs.items()]
                op = bind(runnable(node.target), 'T')
                lines.append(f"    {var} = {f'(P[{i}] or {op})' if placed else op}({', '.join(call)})")
            lines.append(f"    on_alloc({bind(node, 'N')}, {var})")
            for dead in frees:
                lines.append(f"    on_free({bind(dead, 'N')}, {names[dead]}); del {names[dead]}")
        outputs = program.output_node.args[0]
        lines.append(f"    return [{', '.join(arg(o) for o in outputs)}]")
    except _Unsupported:
        return None
    source = f"def run(inputs, on_alloc, on_free{', P' if placed else ''}):\n" + "\n".join(lines) + "\n"
    exec(compile(source, f"<stage {program.gm.__class__.__name__}>", "exec"), scope)
    run = scope["run"]
    run.source = source
    return run


def _holds_node(a: Any) -> bool:
    found = False

    def visit(x):
        nonlocal found
        found = True
        return x
    fx.node.map_arg(a, visit)
    return found
