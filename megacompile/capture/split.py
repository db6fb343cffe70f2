"""Split a stage's joint forward+backward graph into a forward graph and a backward graph.

The forward computes the stage's outputs and the values the backward needs ("saved"); the
backward takes the saved values, the tangents of the outputs, and whatever parameters and
inputs it reads, and returns the gradients. Values that depend on parameters alone (a weight's
transpose, a cast) are not saved: the backward recomputes them from the re-fetched weights, so
no saved value keeps a weight alive on the device between the two passes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass
class SplitGraphs:
    forward: fx.GraphModule    # (params..., acts...) -> (outputs..., saved...)
    backward: fx.GraphModule   # (params[bwd_params]..., acts[bwd_acts]..., saved..., tangents...) -> grads
    n_saved: int
    bwd_params: list[int]
    bwd_acts: list[int]


def is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def split_joint(joint: fx.GraphModule, n_params: int, n_acts: int, n_outputs: int) -> SplitGraphs:
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    params, acts, tangents = (placeholders[:n_params], placeholders[n_params:n_params + n_acts],
                              placeholders[n_params + n_acts:])
    out_node = next(n for n in nodes if n.op == "output")
    flat_out = list(out_node.args[0])
    outputs, grads = flat_out[:n_outputs], flat_out[n_outputs:]

    forward_set = _ancestors(outputs) - set(placeholders)
    # Tuple-valued forward ops: keep every getitem of them in the forward, so the backward
    # reads tensors, never the tuple.
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in forward_set:
            forward_set.add(n)
    backward_need = _ancestors(grads) - set(placeholders)

    # A node "depends on activations" if any input does, or if it draws random numbers.
    act_dependent: set[fx.Node] = set(acts) | set(tangents)
    for n in nodes:
        if n.op == "call_function" and (is_random(n) or any(a in act_dependent for a in n.all_input_nodes)):
            act_dependent.add(n)

    backward_nodes = [n for n in nodes if n in backward_need and n not in forward_set]
    recomputed = [n for n in nodes if n in forward_set and n in backward_need and n not in act_dependent]
    backward_nodes = [n for n in nodes if n in set(backward_nodes) | set(recomputed)]
    backward_set = set(backward_nodes)
    saved = [n for n in nodes if n in forward_set and n not in backward_set
             and any(u in backward_set for u in n.users)]

    # Forward graph.
    fg = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in params + acts:
        env[p] = fg.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in nodes:
        if n in forward_set:
            env[n] = fg.node_copy(n, lambda a: env[a])
    fg.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs) + tuple(env[s] for s in saved))
    forward = fx.GraphModule(joint, fg)

    # Backward graph.
    used = set().union(*(set(n.all_input_nodes) for n in backward_nodes)) | {g for g in grads if isinstance(g, fx.Node)}
    bwd_params = [i for i, p in enumerate(params) if p in used]
    bwd_acts = [i for i, a in enumerate(acts) if a in used]
    bg = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for p in [params[i] for i in bwd_params] + [acts[i] for i in bwd_acts] + saved + tangents:
        benv[p] = bg.placeholder(("saved_" if p in saved else "") + p.name)
        benv[p].meta = dict(p.meta)
    for n in backward_nodes:
        benv[n] = bg.node_copy(n, lambda a: benv[a])
    bg.output(tuple(benv[g] if isinstance(g, fx.Node) else g for g in grads))
    backward = fx.GraphModule(joint, bg)
    return SplitGraphs(forward, backward, len(saved), bwd_params, bwd_acts)
