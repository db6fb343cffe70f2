"""Place each stage's host optimizer step right after the last gradient for its masters lands.

A stage owns the parameters it is the first to use in the forward. A tied parameter (GPT-2's
embedding, reused as the lm head) gets gradients from two stages; its owner's step waits for
both offloads, so the update sees the full gradient.
"""
from __future__ import annotations

from megacompile.ir.program import Node, Op, Program, grads


def place_optimizer(program: Program, owners: dict[int, set[int]]) -> Program:
    """`owners[s]`: the stages whose gradients touch parameters that stage s owns."""
    waited_at: dict[int, int] = {}
    for i, n in enumerate(program.nodes):
        if n.op is Op.WAIT and grads(n.stage) in n.reads:
            waited_at[n.stage] = i
    after: dict[int, list[Node]] = {}
    for s, contributors in sorted(owners.items()):
        if not contributors:
            continue
        missing = [c for c in contributors if c not in waited_at]
        if missing:
            raise ValueError(f"stage {s}'s gradients from stages {missing} are never offloaded")
        at = max(waited_at[c] for c in contributors)
        after.setdefault(at, []).append(Node(Op.OPTIMIZER_STEP, s, origin=program.stage_names[s],
                                             note="AdamW on the host fp32 masters"))
    nodes: list[Node] = []
    for i, n in enumerate(program.nodes):
        nodes.append(n)
        nodes.extend(after.get(i, []))
    return program.copy(nodes)
