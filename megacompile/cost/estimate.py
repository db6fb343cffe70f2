"""Time of one stage graph on a hardware profile: a roofline per ATen op, summed.

FLOPs come from torch's flop counter formulas (torch.utils.flop_counter), applied to the traced
fake values; bytes are what each op reads and writes. An op takes the longer of its compute and
its memory time, plus the profile's fixed per-op overhead (the gated delta rule's operators pay it
for each op the rule runs inside them: cost/delta_rule.py); view ops move nothing. Matmuls run at
the profile's matmul rate; the SDPA kernels (flash, memory-efficient, cuDNN attention and their
backwards) at the share of it the profile's attention_efficiency says, megacompile's own attention
kernel at its fused_attention_efficiency where the profile has one.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from ..ir.stage_program import StageProgram, tensors_of
from ..linear_attention.delta_rule import rule_flops
from .delta_rule import inner_ops
from .hardware import HardwareProfile

aten = torch.ops.aten
VIEWS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.unsqueeze,
         aten.squeeze, aten.slice, aten.select, aten.alias, aten.detach, aten.split, aten.unbind,
         aten.as_strided, aten.split_with_sizes, aten.view_as_real, aten.view_as_complex}


@dataclass(frozen=True)
class GraphCost:
    seconds: float
    flops: float
    bytes_moved: float
    ops: int


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


# The CPU flash-attention kernels take the GPU flash kernels' leading arguments and do the same
# work; torch's counter knows only the GPU ones.
SAME_FLOPS_AS = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}


# Fused kernel nodes (megacompile/fusion) are Python launchers torch's counter does not know. The
# fused lm-head cross-entropy does matmul work: logits, and the hidden and weight gradients, for
# N tokens of width H over V classes: 3 x 2NHV. Attention counts the matmuls kernels/attention.py
# runs: 4 B H S^2 D forward (two), 14 backward (seven: each of its two passes recomputes the
# probabilities; torch counts 10 for the flash backward's five), causal at CAUSAL_SHARE of it.
def _attention_flops(per_pair: float):
    def flops(q, k, v, causal, *rest) -> float:
        batch, heads, seq, dim = q.shape
        return per_pair * batch * heads * seq * seq * dim * (CAUSAL_SHARE if causal else 1.0)
    return flops


def _attention_backward_flops(do, q, k, v, o, lse, causal, *rest) -> float:
    return _attention_flops(14.0)(q, k, v, causal)


KERNEL_FLOPS = {
    "fused_linear_cross_entropy": lambda h, w, *rest: 6.0 * h.numel() * w.shape[0],
    "attention": _attention_flops(4.0),
    "attention_backward": _attention_backward_flops,
}
ATTENTION_FUSED = frozenset({"attention", "attention_backward"})


# The grouped matmul of routed experts (megacompile/moe): every row meets one expert's [K, N]
# weight, 2SKN whatever the routing; its weight gradient likewise.
GROUPED_FLOPS = {
    "grouped_mm": lambda x, w, offs: 2.0 * x.shape[0] * x.shape[1] * w.shape[2],
    "grouped_mm_weight_grad": lambda x, dy, offs: 2.0 * x.shape[0] * x.shape[1] * dy.shape[1],
}


# Sliding-window attention (megacompile/attention/window.py): the kernels' matmuls over the
# (query, key) pairs a window of w keeps, S w - w (w - 1) / 2, tiles at its edges not counted.
def _window_pairs(seq: int, window: int) -> float:
    w = min(seq, window)
    return seq * w - w * (w - 1) / 2


def _window_flops(q, v, window: int, qk: int, pv: int) -> float:
    """2 FLOPs per multiply-add over the pairs the window keeps: `qk` products over the q/k head
    dim (scores, dq, dk) and `pv` over v's (o, dp, dv), which latent attention makes narrower."""
    batch, heads, seq, dim = q.shape
    return 2.0 * batch * heads * _window_pairs(seq, window) * (qk * dim + pv * v.shape[-1])


# Packed documents only narrow it further, by lengths the plan does not know: counted as the window.
# The backward's seven matmuls: scores twice (one per pass), dp twice, dv, dq, dk.
WINDOW_FLOPS = {
    "window_attention": lambda q, k, v, scale, window, *rest: _window_flops(q, v, window, 1, 1),
    "window_attention_backward": lambda do, q, k, v, o, lse, scale, window, *rest: _window_flops(q, v, window, 4, 3),
    "window_attention_sinks_backward": lambda do, q, k, v, o, lse, scale, window, *rest:
        _window_flops(q, v, window, 4, 3),
}


# The chunked gated delta rule (megacompile/linear_attention): its forward's matmuls; the backward
# operator runs the forward again, then autograd's two matmuls for each of the forward's.
LINEAR_ATTENTION_FLOPS = {
    "chunk_gated_delta_rule": lambda q, k, v, *rest: rule_flops(q, v),
    "chunk_gated_delta_rule_backward": lambda do, q, k, v, *rest: 3.0 * rule_flops(q, v),
}


def _own_op(node: fx.Node) -> str | None:
    """The name of a megacompile operator (moe/, attention/), or None."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None and getattr(node.target, "namespace", None) == "megacompile" else None


def node_flops(node: fx.Node) -> float:
    own = _own_op(node)
    if own in GROUPED_FLOPS:
        return GROUPED_FLOPS[own](*fx.node.map_arg(node.args, _val))
    if own in WINDOW_FLOPS:
        return WINDOW_FLOPS[own](*fx.node.map_arg(node.args, _val))
    if own in LINEAR_ATTENTION_FLOPS:
        return LINEAR_ATTENTION_FLOPS[own](*fx.node.map_arg(node.args, _val))
    kernel = node.meta.get("kernel")
    if kernel is not None:
        formula = KERNEL_FLOPS.get(kernel)
        return formula(*fx.node.map_arg(node.args, _val)) if formula else 0.0
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    packet = SAME_FLOPS_AS.get(packet, packet)
    if packet not in flop_registry:
        return 0.0
    args = fx.node.map_arg(node.args, _val)
    kwargs = fx.node.map_arg(node.kwargs, _val)
    try:
        flops = float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # noqa: BLE001 - a formula that cannot read these arguments counts nothing
        return 0.0
    return flops * CAUSAL_SHARE if _causal(node) else flops


# torch's attention formulas count every (query, key) pair; causal attention kernels skip the
# blocks above the diagonal: about half of them at long sequences.
CAUSAL_SHARE = 0.5


def _causal(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return bool(node.args[i] if i < len(node.args) else node.kwargs.get("is_causal", False))


# The fused attention kernels' ATen names; each one's backward is the name with "_backward".
ATTENTION_KERNELS = frozenset(f"{name}{suffix}" for suffix in ("", "_backward") for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention", "_efficient_attention",
    "_flash_attention_forward", "_efficient_attention_forward"))


def is_attention(node: fx.Node) -> bool:
    if node.meta.get("kernel") in ATTENTION_FUSED or _own_op(node) in WINDOW_FLOPS:
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return (packet is not None and getattr(node.target, "namespace", None) == "aten"
            and packet.__name__ in ATTENTION_KERNELS)


def attention_share(node: fx.Node, hw: HardwareProfile) -> float:
    """The share of the matmul rate an attention op runs at: the fused kernel's where the profile
    measured it, else torch's."""
    own_kernel = node.meta.get("kernel") in ATTENTION_FUSED or _own_op(node) in WINDOW_FLOPS
    if own_kernel and hw.fused_attention_efficiency is not None:
        return hw.fused_attention_efficiency
    return hw.attention_efficiency


def node_bytes(node: fx.Node) -> float:
    if getattr(node.target, "overloadpacket", None) in VIEWS or node.target is operator.getitem:
        return 0.0
    seen = set()
    total = 0
    for t in [t for a in node.all_input_nodes for t in tensors_of(a.meta.get("val"))] + tensors_of(node.meta.get("val")):
        key = id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return float(total)


def graph_cost(program: StageProgram, hw: HardwareProfile, dtype: torch.dtype) -> GraphCost:
    """Cached on the program per (profile, dtype): a template's graphs are shared by every block."""
    cache = program.__dict__.setdefault("_costs", {})
    key = (hw, dtype)
    if key in cache:
        return cache[key]
    seconds = flops = moved = 0.0
    ops = 0
    for node in program.body:
        if node.op != "call_function":
            continue
        f, b = node_flops(node), node_bytes(node)
        flops += f
        moved += b
        ops += 1
        seconds += _roofline(node, f, b, hw, dtype)
    cache[key] = GraphCost(seconds, flops, moved, ops)
    return cache[key]


def node_seconds(node: fx.Node, hw: HardwareProfile, dtype: torch.dtype) -> float:
    """One op's share of graph_cost's seconds."""
    return _roofline(node, node_flops(node), node_bytes(node), hw, dtype)


def _roofline(node: fx.Node, flops: float, nbytes: float, hw: HardwareProfile, dtype: torch.dtype) -> float:
    peak = hw.peak_flops(dtype) * hw.matmul_efficiency
    rate = peak * attention_share(node, hw) if flops and is_attention(node) else peak
    return max(flops / rate, nbytes / (hw.device_bw * hw.memory_efficiency)) + hw.op_overhead_s * inner_ops(node)


def recomputed_region(backward: StageProgram, n_tangents: int) -> list[fx.Node]:
    """The nodes of a backward graph that read no tangent (its last `n_tangents` inputs), directly
    or through another node: the forward values it redoes. For a selective variant, the recomputed
    norms, rotary embeddings and activations; for a block that saves everything, values of the
    parameters and constant inputs alone (a transposed weight, an expanded mask)."""
    reads_tangent = set(backward.placeholders[len(backward.placeholders) - n_tangents:])
    region = []
    for node in backward.body:
        if any(a in reads_tangent for a in node.all_input_nodes):
            reads_tangent.add(node)
        elif node.op == "call_function":
            region.append(node)
    return region


def recomputed_bytes(backward: StageProgram, n_tangents: int) -> float:
    """Bytes the recomputed region of a backward graph moves, by node_bytes."""
    return sum(node_bytes(n) for n in recomputed_region(backward, n_tangents))
