"""What runs for a stage graph node's target: the traced op itself, but for `aten.view`, which
becomes a copy where the real input's strides allow no view. The interpreter (stage_program.py)
and the generated code (stage_codegen.py) both call through `runnable`, so they run the same ops.
"""
from __future__ import annotations

from typing import Callable

import torch

_VIEW = torch.ops.aten.view.default


def view_or_copy(*args, **kwargs):
    """aten.view, or where the real input's strides allow none, a copy (reshape). Fake tensors
    predicted strides that allow a view; the real op before it chose others (a cat of two
    gradients laid out as transposes, in Qwen3-Next's gated delta-net backward). The copy holds
    the same values; it would differ from a view only for a later in-place write through it. Its
    bytes are counted where it is made, beyond what the plan predicted for a view."""
    try:
        return _VIEW(*args, **kwargs)
    except RuntimeError:
        return torch.ops.aten.reshape.default(*args, **kwargs)


def runnable(target):
    """What runs for a graph node's target."""
    return view_or_copy if target is _VIEW else target


_OUT_FORMS: dict = {}


def out_form(target) -> tuple | None:
    """(the overload that writes into given tensors, the names of its out arguments) for an ATen op
    that has one taking the same arguments (`aten.mm.default` -> `aten.mm.out`, `out`;
    `aten.silu_backward.default` -> `.grad_input`), one tensor out argument per result (not a
    list: `split_with_sizes_copy.out` takes one); else None."""
    if target in _OUT_FORMS:
        return _OUT_FORMS[target]
    form = None
    if isinstance(target, torch._ops.OpOverload) and target is not _VIEW:
        schema = target._schema
        args = [(a.name, str(a.type)) for a in schema.arguments]
        for name in target.overloadpacket.overloads():
            overload = getattr(target.overloadpacket, name)
            outs = [a.name for a in overload._schema.arguments if a.is_out]
            rest = [(a.name, str(a.type)) for a in overload._schema.arguments if not a.is_out]
            single = all(str(a.type) == "Tensor" for a in overload._schema.arguments if a.is_out)
            if outs and single and len(outs) == len(schema.returns) and rest == args:
                form = (overload, tuple(outs))
                break
    _OUT_FORMS[target] = form
    return form


def allocates_inside(overload) -> bool:
    """Whether an out= form is the one torch generates for an op with no out kernel of its own
    ("autogen" in ATen's native_functions.yaml: `embedding_dense_backward.out`, `clone.out`,
    `native_layer_norm_backward.out`): it runs the op, which allocates its results, and copies them
    into out. Its results are then scratch beside the arena while they are copied, as they are for
    an op with no out= form. Told by the dispatcher: such a form has a CompositeExplicitAutograd
    kernel and none for a device, on every build (a cpu build has no CUDA keys at all)."""
    name = overload.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "CompositeExplicitAutograd") and not has(name, "CPU") and not has(name, "CUDA")


def writes_into(node) -> tuple | None:
    """out_form(node.target) where it places every result of this graph node (each a tensor, one per
    out argument) and is not one torch generates (allocates_inside): the op then writes into its
    arena tensors. Otherwise None: its results, where it makes new storages, are copied into them
    (copied_result_bytes)."""
    form = out_form(node.target)
    results = node.meta.get("val")
    tensors = [results] if isinstance(results, torch.Tensor) else list(results) if isinstance(results, (tuple, list)) else []
    if form is None or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors) or len(form[1]) != len(tensors):
        return None
    return None if allocates_inside(form[0]) else form


_aten = torch.ops.aten
# Factories whose result is a constant (or nothing: the empties): where the result is placed, the
# op need not run at all; its arena tensor is filled in place. Per op, its fill: a constant, the
# name of the argument that holds it, or None (an empty: no fill).
_FILLS = {
    _aten.zeros.default: 0, _aten.new_zeros.default: 0, _aten.zeros_like.default: 0,
    _aten.ones.default: 1, _aten.new_ones.default: 1, _aten.ones_like.default: 1,
    _aten.full.default: "fill_value", _aten.new_full.default: "fill_value", _aten.full_like.default: "fill_value",
    _aten.scalar_tensor.default: "s",
    _aten.empty.memory_format: None, _aten.new_empty.default: None, _aten.empty_like.default: None,
    _aten.empty_strided.default: None,
}

_RANGES = {_aten.arange.default: _aten.arange.out, _aten.arange.start: _aten.arange.start_out,
           _aten.arange.start_step: _aten.arange.start_out}


def in_place_form(node) -> Callable[[torch.Tensor, tuple, dict], None] | None:
    """For an op whose one result can be made in a given tensor without running it: a factory of a
    constant (zeros, ones, full, their _like and new_ forms, scalar_tensor, the empties), arange, a
    cast on one device (`_to_copy`), a clone, a slice's backward, or an embedding's lookup (through
    index_select): the last three are ops whose out= forms torch generates (they allocate the result,
    then copy). A function (that tensor, the op's args, kwargs) -> None that makes the result there
    as the op would have made it (a cast through copy_, which rounds as `.to` does). Else None."""
    result = node.meta.get("val") if node.op == "call_function" else None
    if not isinstance(result, torch.Tensor):
        return None
    if node.target is _aten._to_copy.default:
        source = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
        if isinstance(source, torch.Tensor) and source.device == result.device and result.layout == torch.strided:
            return lambda t, args, kwargs: t.copy_(args[0])
        return None
    if node.target in _RANGES:          # arange's out forms take its scalars, not its dtype
        out = _RANGES[node.target]
        return lambda t, args, kwargs: out(*args, out=t)
    if node.target is _aten.clone.default:        # clone.out is generated: it would clone, then copy
        return lambda t, args, kwargs: t.copy_(args[0])
    if node.target is _aten.slice_backward.default:     # zeros beside the slice the gradient fills
        def slice_grad(t, args, kwargs):
            grad, _, dim, start, end, step = args[:6]
            t.zero_()
            _aten.slice.Tensor(t, dim, start, end, step).copy_(grad)
        return slice_grad
    if node.target is _aten.embedding.default and result.is_contiguous():
        # The lookup is index_select's gather, whose out= form has kernels of its own (embedding's
        # is generated: it would allocate the [tokens, H] rows beside the arena and copy them).
        return lambda t, args, kwargs: torch.index_select(args[0], 0, args[1].reshape(-1),
                                                          out=t.view(-1, t.shape[-1]))
    if node.target not in _FILLS:
        return None
    fill = _FILLS[node.target]
    if fill is None:
        return lambda t, args, kwargs: None
    if isinstance(fill, str):
        position = [a.name for a in node.target._schema.arguments].index(fill)
        return lambda t, args, kwargs: t.fill_(kwargs[fill] if fill in kwargs else args[position])
    return lambda t, args, kwargs: t.fill_(fill)


# Operators of megacompile's own that make every result through kernels/outputs.py on every path:
# the runtime hands them their arena tensors, as it does a fused kernel, and nothing is copied in.
TAKE_THEIR_RESULTS = frozenset({"megacompile::window_attention", "megacompile::window_attention_backward",
                                "megacompile::window_attention_sinks_backward"})


def takes_its_results(node) -> bool:
    name = getattr(node.target, "name", None)
    return hasattr(node.target, "kernel") or (callable(name) and name() in TAKE_THEIR_RESULTS)


def copied_result_bytes(node) -> int:
    """Bytes of the new storages an op returns that are copied into its arena tensors (results that
    are views of its arguments excluded): an op with no out= form, or one whose out= form allocates
    its results inside (allocates_inside). What it holds beside the arena while they are copied in;
    on the H100 the embedding's backward of a 3B model held 752 MiB so."""
    if node.op != "call_function" or writes_into(node) is not None or in_place_form(node) is not None \
            or takes_its_results(node):
        return 0      # written in: through out=, made in place, or taking its results (kernels/outputs.py)
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils import _pytree as pytree
    args = {StorageWeakRef(a.untyped_storage()) for a in pytree.tree_leaves(
        [x.meta.get("val") for x in node.all_input_nodes]) if isinstance(a, torch.Tensor)}
    fresh = {}
    for t in pytree.tree_leaves(node.meta.get("val")):
        if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) not in args:
            fresh[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
    return sum(fresh.values())
