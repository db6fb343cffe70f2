"""Split a stage's joint forward+backward graph into a forward graph and a backward graph.

The forward computes the stage's outputs and the values the backward needs ("saved"); the
backward takes the saved values, the tangents of the outputs, and whatever parameters and
inputs it reads, and returns the gradients. Values that depend on parameters alone (a weight's
transpose, a cast) are not saved: the backward recomputes them from the re-fetched weights, so
no saved value keeps a weight alive on the device between the two passes. Cheap values made only
from parameters and inputs that need no gradient are recomputed too: an attention mask that a
block expands from the prologue's boolean mask ([B, 1, S, S] in bf16, 512 MiB at 16 x 4096) is
rebuilt from that one shared input in the backward instead of being saved by every block.

With `selective`, the backward also recomputes every cheap forward op it needs (elementwise ops,
norms, reshapes, the rotary embedding, mask expansion), so the forward saves only what is costly
to redo: the outputs of matmuls, of attention, and of random ops (a recomputed dropout would
draw other numbers). For a Llama block that is about 45% of the bytes saved otherwise, for a
recompute that adds no matmul FLOPs, only memory-bound passes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef


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


# Ops whose outputs the selective split saves rather than recomputes: the FLOP-heavy ones.
_aten = torch.ops.aten
COSTLY = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.convolution.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._flash_attention_forward.default, _aten._efficient_attention_forward.default,
}


def is_costly(node: fx.Node) -> bool:
    """FLOP-heavy, random, or not an ATen op we know (custom kernels are never recomputed)."""
    target = node.target
    if target is operator.getitem:
        return is_costly(node.args[0])
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return target in COSTLY or is_random(node) or target.namespace != "aten"


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _touched_in_place(nodes: list[fx.Node]) -> set[fx.Node]:
    """In-place ops, every value they write to, and every value sharing storage with one (the
    buffer a write through a slice fills)."""
    touched: set[fx.Node] = set()
    for n in nodes:
        if n.op == "call_function" and _mutates(n):
            touched.add(n)
            touched.update(n.all_input_nodes)
    written = {_storage(n) for n in touched} - {None}
    touched.update(n for n in nodes if _storage(n) in written)
    return touched


def _read_before_written(nodes: list[fx.Node], forward_set: set[fx.Node]) -> set[fx.Node]:
    """Nodes that read a value before a forward op writes it in place, with what they read.

    Autograd copies the operand of an in-place op whose original value its backward needs (the
    `clone` before Mixtral's router divides its top-k weights in place, `/=`). Only the gradient
    reads that copy, but it must be made where it stands, in the forward: moved to the backward it
    would copy the value already written."""
    position = {n: i for i, n in enumerate(nodes)}
    found: set[fx.Node] = set()
    for m in nodes:
        if m not in forward_set or m.op != "call_function" or not _mutates(m):
            continue
        schema = m.target._schema
        written = [m.args[i] if i < len(m.args) else m.kwargs.get(a.name) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        for value in written:
            if not isinstance(value, fx.Node):
                continue
            for reader in value.users:
                if position[reader] < position[m] and reader not in forward_set:
                    found |= ancestors([reader])
    return found


def _storage(node: fx.Node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return StorageWeakRef(val.untyped_storage())


def _writes_into_forward(nodes: list[fx.Node], forward_set: set[fx.Node]) -> set[fx.Node]:
    """In-place writes into the storage of a forward value before a forward node reads it.

    A write through a view (`k[..., :d] = x`: a slice, then copy_) is no ancestor of the value
    read later (`k`), yet that value is what the write filled."""
    position = {n: i for i, n in enumerate(nodes)}
    found: set[fx.Node] = set()
    changed = True
    while changed:
        changed = False
        read_at: dict = {}     # storage -> last position a forward node holds or reads it
        for n in forward_set | found:
            # A reader counts, not only a holder: an op whose result shares nothing with the
            # buffer (megacompile::window_attention reading DeepSeek's filled key) reads it last.
            for ref in {_storage(n), *(_storage(a) for a in n.all_input_nodes)} - {None}:
                read_at[ref] = max(read_at.get(ref, -1), position[n])
        for m in nodes:
            if m in forward_set or m in found or m.op != "call_function" or not _mutates(m):
                continue
            schema = m.target._schema
            written = [m.args[i] if i < len(m.args) else m.kwargs.get(a.name)
                       for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
            if any(_storage(w) is not None and read_at.get(_storage(w), -1) > position[m] for w in written):
                found |= ancestors([m])
                changed = True
    return found


def _dependents(nodes: list[fx.Node], sources: set[fx.Node]) -> set[fx.Node]:
    """`sources`, the nodes that read any of them, transitively, and every random op."""
    found = set(sources)
    for n in nodes:
        if n.op == "call_function" and (is_random(n) or any(a in found for a in n.all_input_nodes)):
            found.add(n)
    return found


def ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    """The nodes the roots read, directly or through others, the roots included."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _lazy_order(backward_only: list[fx.Node], recomputed: set[fx.Node]) -> list[fx.Node]:
    """The backward's nodes, each recomputed one placed just before its first reader, so a
    recomputed value is alive only from where it is needed, not from the start of the backward."""
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()

    def place(n: fx.Node) -> None:
        # Iterative post-order: a chain of recomputed ops can be as long as the block.
        stack = [(n, False)]
        while stack:
            m, ready = stack.pop()
            if m in placed:
                continue
            if ready:
                placed.add(m)
                order.append(m)
                continue
            stack.append((m, True))
            stack.extend((a, False) for a in reversed(m.all_input_nodes) if a in recomputed and a not in placed)

    for n in backward_only:
        place(n)
    return order


def split_joint(joint: fx.GraphModule, n_params: int, n_acts: int, n_outputs: int,
                selective: bool = False, grad_acts: list[int] | None = None) -> SplitGraphs:
    """`grad_acts`: the inputs a gradient flows back to (default: all of them); the others
    (masks, rotary tables, positions) are constants of the step, as the parameters are."""
    nodes = list(joint.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    params, acts, tangents = (placeholders[:n_params], placeholders[n_params:n_params + n_acts],
                              placeholders[n_params + n_acts:])
    out_node = next(n for n in nodes if n.op == "output")
    flat_out = list(out_node.args[0])
    outputs, grads = flat_out[:n_outputs], flat_out[n_outputs:]

    forward_set = ancestors(outputs) - set(placeholders)
    forward_set |= _read_before_written(nodes, forward_set) - set(placeholders)
    forward_set |= _writes_into_forward(nodes, forward_set) - set(placeholders)
    # Tuple-valued forward ops: keep every getitem of them in the forward, so the backward
    # reads tensors, never the tuple.
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] in forward_set:
            forward_set.add(n)
    backward_need = ancestors(grads) - set(placeholders)

    # A node "depends on activations" if any input does, or if it draws random numbers; it
    # "depends on gradient inputs" if it does so through an input that a gradient flows back to.
    wrt_acts = [acts[i] for i in grad_acts] if grad_acts is not None else acts
    act_dependent = _dependents(nodes, set(acts) | set(tangents))
    grad_dependent = _dependents(nodes, set(wrt_acts) | set(tangents))

    # Walk back from what the backward-only nodes read: a forward node is recomputed in the
    # backward if it depends on parameters alone, if it is cheap and depends on no input that
    # needs a gradient (or, with `selective`, if it is cheap), else saved.
    # In-place ops (dropout's div_ on its mask) make a value differ before and after them: a
    # recompute could see the other version, or mutate a saved value twice. Values they touch
    # are never recomputed.
    touched = _touched_in_place(nodes)

    def recomputable(n: fx.Node) -> bool:
        if n.op != "call_function":
            return False
        if n not in act_dependent:
            return True
        cheap = not is_costly(n) and n not in touched and not touched.intersection(n.all_input_nodes)
        return cheap and (selective or n not in grad_dependent)

    backward_only = [n for n in nodes if n in backward_need and n not in forward_set]
    recomputed: set[fx.Node] = set()
    saved_set: set[fx.Node] = set()
    stack = [a for n in backward_only for a in n.all_input_nodes if a in forward_set]
    stack += [g for g in grads if isinstance(g, fx.Node) and g in forward_set]
    while stack:
        n = stack.pop()
        if n in recomputed or n in saved_set:
            continue
        if recomputable(n):
            recomputed.add(n)
            stack.extend(a for a in n.all_input_nodes if a in forward_set)
        else:
            saved_set.add(n)
    backward_nodes = _lazy_order(backward_only + [g for g in grads if g in recomputed], recomputed)
    saved = [n for n in nodes if n in saved_set]

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
