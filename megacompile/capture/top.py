"""Trace the model's forward once at ATen level, with each decoder block as one leaf call."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..errors import CaptureError, MegacompileError
from .alike import sampled_groups, structure_key
from .blocks import BlockStack, same_constants
from .checkpointing import without_gradient_checkpointing
from .deepstack import deepstack_in_blocks
from .fingerprint import record
from .image_tokens import traced_inputs
from .leaf import BlockCall, clear_out_meta, set_out_meta
from .loss import LossFn, extract_loss, extract_outputs
from .rope_positions import held_rope_deltas
from .side_outputs import active_keys, hand_back, recording
from .state_writes import refuse_state_writes
from .untouched import as_it_was


@dataclass
class TopGraph:
    gm: fx.GraphModule
    state_names: list[str]         # placeholders 0..len-1: parameters then buffers, by model name
    n_inputs: int                  # then the model's input tensors (flattened args, kwargs)
    calls: list[BlockCall]         # one per block, in call order
    out_spec: pytree.TreeSpec | None  # eval mode: the model output's tree (loss mode: None)
    out_constants: list[Any]
    out_is_tensor: list[bool]
    extra_names: tuple[str, ...] = ()  # training: the outputs handed out beside the loss (LossAndOutputs)


# Within blocks_grouped_once(): per block stack, which earlier block each block computed the same
# as (same fingerprint, call constants and input shapes) in the first capture.
_GROUPS: ContextVar[dict | None] = ContextVar("megacompile_block_groups", default=None)


@contextlib.contextmanager
def blocks_grouped_once():
    """For planning, never a training capture. The first capture of a model runs the op log over
    the first two and the last block of each group its modules tell apart (alike.py), and gives
    the others the first's fingerprint and output shapes; later captures (plan_global_batch: one
    per micro-batch size) run it only for the first block of each group, when the call constants
    and input shapes agree with it again. Control flow that changes with the layer number or the
    batch size in some unsampled layers only would go unseen. Nested, the outer groups hold."""
    if _GROUPS.get() is not None:
        yield
        return
    token = _GROUPS.set({})
    try:
        yield
    finally:
        _GROUPS.reset(token)


# Within blocks_logged_before(memo): per block, the calls earlier captures of its model logged.
_LOGGED: ContextVar[dict | None] = ContextVar("megacompile_logged_blocks", default=None)
_LOGGED_KEPT = 8       # calls kept per block: as many as the engine keeps captures


@contextlib.contextmanager
def blocks_logged_before(memo: dict):
    """The captures of one model inside (an engine's, one per input shape) log a block only when
    no capture inside logged it called the same way before (the same constants, input shapes and
    work folded in); one that did gives its fingerprint and output shapes. A vision-language run
    meeting a new image size so logs its tower's blocks again, not its language model's, whose
    inputs did not change. A block whose modules changed since (alike.structure_key: eval(), a
    parameter frozen, an attribute set) is logged again; its class's code is taken not to change.
    `memo` is the caller's, kept between the captures."""
    token = _LOGGED.set(memo)
    try:
        yield
    finally:
        _LOGGED.reset(token)


def _logged_before(block: nn.Module, index: int, train: bool, probe: BlockCall, shapes: list,
                   built: tuple | None) -> BlockCall | None:
    """An earlier capture's call of this block called and built as it is now (`built`: its
    structure_key before capturing patched its forward: a flag set by eval(), a parameter frozen)."""
    memo = _LOGGED.get()
    kept = () if memo is None else memo.get((id(block), index, train), ())
    for call, its_shapes, its_built in reversed(kept):
        if its_shapes == shapes and not call.side_keys and _same_call(probe, call) and its_built == built:
            return call
    return None


def _log(block: nn.Module, index: int, train: bool, call: BlockCall, shapes: list, built: tuple | None) -> None:
    memo = _LOGGED.get()
    if memo is not None and not call.side_keys:
        kept = memo.setdefault((id(block), index, train), [])
        kept.append((call, shapes, built))
        del kept[:-_LOGGED_KEPT]


_ABSENT = object()


class _LogEveryBlock(Exception):
    """A sampled block computed otherwise than its group's first: capture again, logging all."""


def _same_call(a: BlockCall, b: BlockCall) -> bool:
    try:
        return (a.in_spec == b.in_spec and same_constants(a.constants, b.constants) and not a.collect_keys
                and a.attached_key == b.attached_key)
    except Exception:  # noqa: BLE001 - constants that do not compare are not the same call
        return False


def _alike(c: BlockCall, d: BlockCall, shapes: dict[int, list]) -> bool:
    """Whether block call `c` computes what the earlier `d` does, so it may share its template."""
    return (d.fingerprint == c.fingerprint and shapes[d.index] == shapes[c.index] and _same_call(c, d)
            and not d.side_keys)


def _contradicts(check: BlockCall, first: BlockCall, shapes: dict[int, list]) -> bool:
    """Whether a sampled block, called as its group's first was, computed otherwise. One called
    otherwise (other constants or shapes: the last of Qwen2.5-VL's tower attends over whole images
    where the first attends within windows) was logged for itself, as is every block so called,
    and says nothing of the blocks that took the first's fingerprint."""
    if shapes[check.index] != shapes[first.index] or not _same_call(check, first):
        return False
    return not _alike(check, first, shapes)


@contextlib.contextmanager
def _blocks_as_leaves(model: nn.Module, stack: BlockStack | None, calls: list[BlockCall], train: bool):
    """Patch each block's forward to record its call and emit one megacompile::block_call; the
    deepstack work that follows a block (deepstack.py) is folded into its call."""
    if stack is None:
        yield
        return
    originals = [b.forward for b in stack.blocks]

    def make_leaf(index: int, original: Callable):
        def leaf(*args, **kwargs):
            leaves, in_spec = pytree.tree_flatten((args, kwargs))
            positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
            block = stack.blocks[index]
            attached, extra = deepstack.for_call(index)

            def run(tensors: list[torch.Tensor]):
                own = list(leaves)
                for pos, t in zip(positions, tensors):
                    own[pos] = t
                a, kw = pytree.tree_unflatten(own, in_spec)
                out = original(*a, **kw)
                return (out, []) if attached is None else attached.apply(out, None, tensors[len(positions):])
            keys = active_keys()
            inputs = [leaves[i] for i in positions] + extra
            shapes[index] = [(t.shape, t.dtype, t.requires_grad) for t in inputs]
            # The group's first logged block, or (where work is folded into some of its blocks:
            # Qwen3-VL's first decoder layers) its first logged block with the same work.
            j = known.get(index)
            key = None if attached is None else attached.key
            like = next((c for c in calls if j is not None and (c.index == j or known.get(c.index) == j)
                         and c.attached_key == key), None)
            probe = BlockCall(in_spec, constants, positions, None, [], [], index, (), keys, attached=attached)
            if like is None or shapes[like.index] != shapes[index] or not _same_call(probe, like):
                like = _logged_before(block, index, train, probe, shapes[index], built.get(index))
            if like is not None:
                calls.append(BlockCall(in_spec, constants, positions, like.out_spec, like.out_meta,
                                       like.out_constants, index, like.fingerprint, keys, (), attached,
                                       like.attached_meta))
                side = None
            else:
                with disable_proxy_modes_tracing():   # fake tensors only: the output's shapes, the fingerprint
                    with recording(keys) as side:
                        named = attached.tensors() if attached is not None else None
                        (out, added), fingerprint = record(block, run, inputs, train, named)
                out_leaves, out_spec = pytree.tree_flatten(out)
                meta = [(x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else None for x in out_leaves]
                out_constants = [None if isinstance(x, torch.Tensor) else x for x in out_leaves]
                calls.append(BlockCall(in_spec, constants, positions, out_spec, meta, out_constants, index,
                                       fingerprint, keys, side.tensor_keys, attached,
                                       [(x.shape, x.dtype, x.device) for x in added]))
                _log(block, index, train, calls[-1], shapes[index], built.get(index))
            meta = calls[-1].out_meta
            side_meta = [] if side is None else [(x.shape, x.dtype, x.device) for x in side.tensors]
            set_out_meta(index, [m for m in meta if m is not None] + side_meta + calls[-1].attached_meta)
            tensors = torch.ops.megacompile.block_call(inputs, index)
            returned = sum(m is not None for m in meta)
            n_side = len(side_meta)
            if side is not None:
                hand_back(side, tensors[returned:returned + n_side])
            output = calls[-1].rebuild_output(tensors[:returned])
            deepstack.hand_over(output, tensors[returned + n_side:])
            return output
        return leaf

    groups = _GROUPS.get()
    stack_key = tuple(id(b) for b in stack.blocks)
    known: dict[int, int] = {}
    checks: dict[int, int] = {}    # logged blocks that check a group -> its first
    if groups is not None and stack_key in groups:
        known = groups[stack_key]
    elif groups is not None and (stack_key, "log every block") not in groups:
        known, checks = sampled_groups(stack.blocks)
    shapes: dict[int, list] = {}
    # A module the list holds several times (nn.ModuleList([b, b, b])) is one block applied again:
    # each call records the index of its first place, as a block the model calls twice does.
    first_place: dict[int, int] = {}
    for i, block in enumerate(stack.blocks):
        first_place.setdefault(id(block), i)
    patched = [(i, block, block.__dict__.get("forward", _ABSENT)) for i, block in enumerate(stack.blocks)
               if first_place[id(block)] == i]
    # Each block as built before its forward is patched here, where earlier captures are consulted
    built = {i: structure_key(block) for i, block, _ in patched} if _LOGGED.get() is not None else {}
    try:
        for i, block, _ in patched:
            block.forward = make_leaf(i, originals[i])
        with deepstack_in_blocks(model, stack.blocks) as deepstack:
            yield
        by_index = {c.index: c for c in calls}
        # A stack the model did not call (a vision tower, given no image) checks nothing; nor do
        # blocks told apart by the work folded into them, which the model's structure names.
        if any(_contradicts(by_index[i], by_index[j], shapes) for i, j in checks.items()
               if i in by_index and j in by_index and by_index[i].attached_key == by_index[j].attached_key):
            groups[(stack_key, "log every block")] = True
            raise _LogEveryBlock
        if groups is not None and stack_key not in groups:
            first: dict[int, int] = {}
            for c in calls:
                like = next((d for d in calls if d.index < c.index and _alike(c, d, shapes)), None)
                if like is not None:
                    first[c.index] = first.get(like.index, like.index)
            groups[stack_key] = first
    finally:
        for _, block, own in patched:
            if own is _ABSENT:
                block.__dict__.pop("forward", None)     # back to the class's forward
            else:
                block.forward = own
        clear_out_meta()


def trace_top(model: nn.Module, stack: BlockStack | None, state: dict[str, torch.Tensor],
              args: tuple, kwargs: dict, loss_fn: LossFn | None, train: bool) -> TopGraph:
    """ATen forward graph of `model` on the fake tensors `state` (parameters and buffers).

    In training the graph returns the scalar loss; otherwise the model's output tensors.
    """
    names = list(state)
    in_leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(in_leaves) if isinstance(x, torch.Tensor)]
    calls: list[BlockCall] = []
    out_info: dict[str, Any] = {}

    def forward(state_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor]):
        leaves = list(in_leaves)
        for pos, t in zip(tensor_pos, input_tensors):
            leaves[pos] = t
        a, kw = pytree.tree_unflatten(leaves, in_spec)
        with traced_inputs(input_tensors):
            output = functional_call(model, dict(zip(names, state_tensors)), a, kw, strict=False)
        if train:
            extras = extract_outputs(output)
            out_info["extra_names"] = tuple(extras)
            return [extract_loss(output, loss_fn, a, kw), *extras.values()]
        out_leaves, out_info["spec"] = pytree.tree_flatten(output)
        held = held_rope_deltas(model)      # returned as the model holds them, not computed by the graph
        out_info["is_tensor"] = [isinstance(x, torch.Tensor) and id(x) not in held for x in out_leaves]
        out_info["constants"] = [held.get(id(x)) if isinstance(x, torch.Tensor) else x for x in out_leaves]
        return [x for x, is_tensor in zip(out_leaves, out_info["is_tensor"]) if is_tensor]

    try:
        with as_it_was(model), without_gradient_checkpointing(model):
            try:
                with _blocks_as_leaves(model, stack, calls, train):
                    gm = make_fx(forward, tracing_mode="fake")(list(state.values()), [in_leaves[i] for i in tensor_pos])
            except _LogEveryBlock:
                calls.clear()
                with _blocks_as_leaves(model, stack, calls, train):
                    gm = make_fx(forward, tracing_mode="fake")(list(state.values()), [in_leaves[i] for i in tensor_pos])
    except MegacompileError:
        raise
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one clear error
        raise CaptureError(_describe_trace_failure(model, e)) from e
    refuse_state_writes(gm, names, f"{type(model).__name__}")
    calls = _drop_unread(gm, calls)
    return TopGraph(gm, names, len(tensor_pos), calls, out_info.get("spec"),
                    out_info.get("constants", []), out_info.get("is_tensor", []), out_info.get("extra_names", ()))


def _drop_unread(gm: fx.GraphModule, calls: list[BlockCall]) -> list[BlockCall]:
    """Drop what the model computes and never reads (CLIP's pooled output, which LLaVA leaves
    unused): it would land in the epilogue, reading the prologue past the blocks. A block whose
    outputs nothing reads goes too (LLaVA takes the features of the tower's second-to-last layer:
    its last layer's parameters get no gradient, as eagerly), unless it draws random numbers.
    Random draws and in-place writes stay (fx keeps impure nodes), so the random stream advances
    as eagerly. Returns the calls left, in call order."""
    block_call = torch.ops.megacompile.block_call.default
    by_index = {c.index: c for c in calls}

    def kept(n: fx.Node) -> bool:
        if n.target is block_call:
            return _draws(by_index[n.args[1]])
        return n.is_impure(impure_random=True)
    gm.graph.eliminate_dead_code(kept)
    gm.recompile()
    left = [n.args[1] for n in gm.graph.nodes if n.target is block_call]
    return [by_index[i] for i in left]


def _draws(call: BlockCall) -> bool:
    """Whether the block's logged ops draw random numbers (a dropout). Attention ops are tagged as
    drawing whatever their dropout_p; at 0 they draw nothing."""
    ops = call.fingerprint[0] if call.fingerprint else ()
    return not call.fingerprint or any(_random(f, args, kwargs) for f, args, kwargs in ops)


def _random(func, args: tuple, kwargs: tuple) -> bool:
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    given = dict(kwargs)
    i = names.index("dropout_p")
    p = args[i] if i < len(args) else given.get("dropout_p", ("float", (0.0).hex()))
    return not (isinstance(p, tuple) and p[0] == "float" and float.fromhex(p[1]) == 0.0) and p != 0


def _describe_trace_failure(model: nn.Module, e: Exception) -> str:
    """Name the innermost module and the op the trace stopped at, from the traceback."""
    module_path, op = "<top level>", type(e).__name__
    tb = e.__traceback__
    modules = {id(m): n for n, m in model.named_modules()}
    while tb is not None:
        self_obj = tb.tb_frame.f_locals.get("self")
        if isinstance(self_obj, nn.Module) and id(self_obj) in modules:
            module_path = modules[id(self_obj)] or type(model).__name__
            op = f"{type(self_obj).__name__}.{tb.tb_frame.f_code.co_name} line {tb.tb_lineno}"
        tb = tb.tb_next
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"cannot capture the model: module '{module_path}' ({op}) failed while tracing: "
            f"{type(e).__name__}: {first_line.rstrip('.')}. megacompile traces with fake tensors; code that "
            "reads tensor values in Python (.item(), data-dependent control flow, numpy) cannot be "
            "captured: compute it with torch ops, or move it out of forward()")
