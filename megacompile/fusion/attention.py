"""Fused-SDPA attention onto kernels/attention.py, so attention writes its results into the arena.

    forward   _scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=)          (GPU)
              _scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=)  (CPU)
    backward  their _backward ops

torch's flash ops allocate their results themselves, so the arena can only copy them in; their
backward also holds a float32 dq accumulator and, under grouped-query attention, dk and dv for
every query head: at a 7B shape at 4 x 4096 tokens 642 MiB, at 512k tokens 20 GiB, all op scratch
beside the arena. The kernel writes o and lse, or dq, dk, dv and its one temporary, where the plan
put them. It keeps the flash ops' result layouts and the meaning of lse, so the forward and the
backward are rewritten each on its own: a forward whose extra outputs (the GPU op's rng state and
cumulative lengths) its ATen backward still reads stays ATen until that backward is rewritten.

Only what the kernel computes exactly as the op does is rewritten: no dropout, no attention mask,
no nested (packed) rows, query and key of one length, the head dim read contiguous, at most 65535
(batch x heads). Everything else
(sliding windows and padding masks come as masks; the memory-efficient and cuDNN ops save other
values) stays ATen.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph import GraphEdit, alive
from .launchers import attention_bwd, attention_fwd
from .match import is_call, val

aten = torch.ops.aten

# op -> (index of is_causal in args, index of dropout_p in args)
FORWARD = {aten._scaled_dot_product_flash_attention.default: (4, 3),
           aten._scaled_dot_product_flash_attention_for_cpu.default: (4, 3)}
BACKWARD = {aten._scaled_dot_product_flash_attention_backward.default: (11, 10),
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (7, 6)}


# The kernels' grids run (batch x heads) along CUDA's second grid axis, which holds 65535.
MAX_GRID_Y = 65535


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if index < len(node.args) else node.kwargs.get(name, default)


def _exact(node: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, dropout_at: int) -> bool:
    """The kernel computes what the op does: no dropout, no mask, one length, contiguous head dims."""
    if _arg(node, dropout_at, "dropout_p", 0.0) != 0.0 or node.kwargs.get("attn_mask") is not None:
        return False
    qv, kv, vv = val(q), val(k), val(v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.stride(-1) == 1 for t in (qv, kv, vv)):
        return False
    batch, hq, seq, dim = qv.shape
    if batch * hq > MAX_GRID_Y:
        return False
    return (tuple(kv.shape) == tuple(vv.shape) == (batch, kv.shape[1], seq, dim) and hq % kv.shape[1] == 0
            and qv.dtype == kv.dtype == vv.dtype and qv.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _rows_of(t: fx.Node, q: fx.Node) -> bool:
    """t (the output or its gradient) is laid out as the kernel reads it: q's shape and dtype, the
    head dim contiguous."""
    tv, qv = val(t), val(q)
    return isinstance(tv, torch.Tensor) and tv.shape == qv.shape and tv.dtype == qv.dtype and tv.stride(-1) == 1


def _items(node: fx.Node) -> dict[int, fx.Node]:
    """The getitem readers of a tuple-valued node, by index; None when anything else reads it."""
    items = {}
    for u in node.users:
        if not (is_call(u, operator.getitem) and isinstance(u.args[1], int)):
            return None
        items.setdefault(u.args[1], u)
    return items


def attention_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, set(FORWARD)):
            continue
        causal_at, dropout_at = FORWARD[node.target]
        q, k, v = node.args[:3]
        items = _items(node)
        if items is None or not _exact(node, q, k, v, dropout_at):
            continue
        if any(i > 1 and item.users for i, item in items.items()):
            continue     # the ATen backward still reads the GPU op's rng state or lengths
        results = val(node)
        if tuple(results[1].shape) != tuple(val(q).shape[:3]):
            continue     # a log-sum-exp padded past the sequence: not the kernel's layout
        args = (q, k, v, bool(_arg(node, causal_at, "is_causal", False)), node.kwargs.get("scale"),
                tuple(results[0].stride()), tuple(results[1].stride()))
        replaces = {i: items[i] for i in (0, 1) if i in items}
        if edit.replace(attention_fwd, args, {}, replaces, [node, *items.values()]):
            _erase(edit, node, items)
            count += 1
    return count


def _erase(edit: GraphEdit, node: fx.Node, items: dict[int, fx.Node]) -> None:
    """The replaced op and its getitems. The flash ops are tagged as drawing random numbers (for
    dropout), which dce leaves alone; with dropout 0 they draw none."""
    for item in items.values():
        if not item.users:
            edit.graph.erase_node(item)
    if not node.users:
        edit.graph.erase_node(node)


def attention_backward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, set(BACKWARD)):
            continue
        causal_at, dropout_at = BACKWARD[node.target]
        do, q, k, v, out, lse = node.args[:6]
        items = _items(node)
        if items is None or not _exact(node, q, k, v, dropout_at) or not _rows_of(do, q) or not _rows_of(out, q) \
                or tuple(val(lse).shape) != tuple(val(q).shape[:3]):
            continue
        grads = val(node)
        args = (do, q, k, v, out, lse, bool(_arg(node, causal_at, "is_causal", False)), node.kwargs.get("scale"),
                *(tuple(g.stride()) for g in grads[:3]))
        if edit.replace(attention_bwd, args, {}, dict(items), [node, *items.values()]):
            _erase(edit, node, items)
            count += 1
    return count
