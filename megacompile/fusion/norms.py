"""RMSNorm and LayerNorm, forward and backward, onto kernels/rms_norm.py and kernels/layer_norm.py.

RMSNorm has no ATen op: HF's LlamaRMSNorm (Llama, Qwen2, Mistral) traces to

    xf = x.to(float32)                          # only when x is not float32 already
    rstd = rsqrt(mean(pow(xf, 2), [-1], keepdim) + eps)
    y = w * (xf * rstd).to(x.dtype)

and autograd writes its backward as two terms of dx (summed, or added one at a time into the
residual gradient) and a sum for dw:

    c = (dy * w).to(float32)
    dx = c * rstd + (sum(c * xf, -1) * -0.5 * rstd**3 / N) * (xf**1.0 * 2.0)
    dw = sum(dy * xhat, leading dims)           # xhat: the saved (xf * rstd).to(x.dtype)

A frozen weight (LoRA) has no dw sum: the kernel then makes dx alone (weight_grad=False), reading
the same x and rstd, so a frozen norm's saved values shrink as a trained one's do.

LayerNorm is one ATen op each way (native_layer_norm, native_layer_norm_backward), mapped whole; a
frozen weight and bias (output mask [True, False, False]) map to the kernel without the dw and db sums.
The backward rewrites run first (see megacompile/fusion/__init__.py): they read only what the forward
already saves (x, rstd), so the saved xhat falls out of the contract and the forward group is free.
"""
from __future__ import annotations


import torch
import torch.fx as fx

from .contract import StagePair
from .graph import GraphEdit, alive
from .launchers import layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd
from .match import ANY, Const, Op, Var, equals, first_match, getitems, is_call, matches, maybe_cast, number, val

aten = torch.ops.aten
MUL = {aten.mul.Tensor, aten.mul.Scalar}
DIV = {aten.div.Scalar, aten.div.Tensor}
POW = aten.pow.Tensor_Scalar


def _dims(d) -> bool:
    return isinstance(d, (list, tuple)) and len(d) == 1 and isinstance(d[0], int)


def _is_last(node: fx.Node, dims) -> bool:
    return dims[0] in (-1, val(node).dim() - 1)


_MEAN_SQUARE = Op(aten.mean.dim, Op(POW, Var("xf"), Const(equals(2))), Const(_dims, "dims"), True)
RSTD = Op(aten.rsqrt.default, Op(aten.add.Tensor, _MEAN_SQUARE, Const(number, "eps")), name="rstd")
RMS_FORWARD = Op(aten.mul.Tensor, Var("w"), maybe_cast(Op(aten.mul.Tensor, Var("xf"), RSTD, name="xhat")), name="y")
XHAT = maybe_cast(Op(aten.mul.Tensor, Var("xf"), Var("rstd")))

WDY = maybe_cast(Op(aten.mul.Tensor, Var("dy"), Var("w")), torch.float32)
TERM_A = Op(aten.mul.Tensor, Var("c"), Var("rstd"))
_ROW_SUM = Op(aten.sum.dim_IntList, Op(aten.mul.Tensor, Var("c"), Var("xf")), Const(_dims, "dims"), True)
_D_RSTD = Op(aten.mul.Tensor, Op(MUL, _ROW_SUM, Const(equals(-0.5))), Op(POW, Var("rstd"), Const(equals(3))))
TERM_B = Op(aten.mul.Tensor,
            Op(DIV, Op(aten.expand.default, _D_RSTD, ANY), Const(number, "n")),
            Op(MUL, Op(POW, Var("xf"), Const(equals(1))), Const(equals(2))))
DW = Op(aten.view.default,
        Op(aten.sum.dim_IntList, Op(aten.mul.Tensor, Var("dy"), Var("xhat")), Const(list), True), ANY)


# -- RMSNorm ------------------------------------------------------------------------------------
def rms_norm_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.mul.Tensor):
            continue
        for b in matches(RMS_FORWARD, node):
            xf, w = b["xf"], b["w"]
            x, keep = xf, []
            if is_call(xf, aten._to_copy.default) and val(xf).dtype == torch.float32:
                x, keep = xf.args[0], [xf]
            if not (_is_last(xf, b["dims"]) and val(w).dim() == 1 and val(w).shape[0] == val(x).shape[-1]
                    and val(x).dtype.is_floating_point):
                continue
            if edit.replace(rms_norm_fwd, (x, w, float(b["eps"])), {}, {0: b["y"], 1: b["rstd"]},
                            b.nodes, keep=keep):
                count += 1
                break
    return count


def rms_norm_backward(pair: StagePair) -> int:
    edit = pair.bwd
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.mul.Tensor):
            continue
        b = first_match(TERM_B, node)
        if b is None or not _is_last(b["xf"], b["dims"]) or float(b["n"]) != val(b["xf"]).shape[-1]:
            continue
        c, rstd, xf = b["c"], b["rstd"], b["xf"]
        wdy = next((m for m in matches(WDY, c) if val(m["w"]).dim() == 1 and val(m["dy"]).shape == val(xf).shape),
                   None)   # dy * w in either order: w is the [N] one
        if wdy is None:
            continue
        dy, w = wdy["dy"], wdy["w"]
        term_a = next((u for u in c.users if u is not node and first_match(TERM_A, u, {"c": c, "rstd": rstd})), None)
        wdy_mul = next(n for n in wdy.nodes if is_call(n, aten.mul.Tensor))
        dw = _dw(pair, dy, wdy_mul, xf, rstd)
        if term_a is None or not pair.holds(RSTD, rstd, {"xf": xf}):
            continue
        if dw is not None and (len(val(dw.nodes[0]).shape) != 1 or val(dw.nodes[0]).shape != val(w).shape):
            continue
        dx = edit.sum_of(term_a, node)
        if dx is None:
            continue
        # no dw sum beside dx: a frozen weight (where one is there but not matched, it stays eager beside
        # the kernel, which refuses only if the group's nodes are read outside it)
        grads, weight_grad = ({0: dx}, False) if dw is None else ({0: dx, 1: dw.nodes[0]}, True)
        group = list(b.nodes) + list(wdy.nodes) + [term_a] + (list(dw.nodes) if dw is not None else []) + [dx]
        if edit.replace(rms_norm_bwd, (dy, _narrow(pair, xf), w, rstd, weight_grad), {}, grads, group):
            count += 1
    return count


def _narrow(pair: StagePair, xf: fx.Node) -> fx.Node:
    """The kernel reads x in its own dtype: where the forward saved HF's fp32 copy of a bf16/fp16 x,
    read x itself (a block input, or saved at half the bytes) and let the fp32 copy leave the saved
    values. The kernel computes in fp32 from the same values, so only the bytes change. Where the
    backward makes the copy itself (a selective variant recomputes the norm), it reads x there."""
    if _widened(xf):
        return xf.args[0]
    f_xf = pair.forward_of(xf)
    if f_xf is None or pair.pending or not _widened(f_xf):
        return xf
    return pair.input_for(f_xf.args[0])


def _widened(node: fx.Node) -> bool:
    """node is a bf16/fp16 value cast to float32."""
    return (is_call(node, aten._to_copy.default) and val(node).dtype == torch.float32
            and val(node.args[0]).dtype in (torch.bfloat16, torch.float16))


def _dw(pair: StagePair, dy: fx.Node, wdy_mul: fx.Node, xf: fx.Node, rstd: fx.Node):
    """The match of dw = view(sum(dy * xhat, leading dims)) beside wdy_mul among dy's readers."""
    for u in dy.users:
        if u is wdy_mul or not is_call(u, aten.mul.Tensor):
            continue
        for s in u.users:
            for v in s.users:
                b = first_match(DW, v, {"dy": dy})
                if (b is not None and u in b.nodes and list(s.args[1]) == list(range(val(dy).dim() - 1))
                        and pair.holds(XHAT, b["xhat"], {"xf": xf, "rstd": rstd})):
                    return b
    return None


# -- LayerNorm ----------------------------------------------------------------------------------
def layer_norm_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not is_call(node, aten.native_layer_norm.default):
            continue
        x, shape, w, b, eps = node.args
        if w is None or b is None or list(shape) != [val(x).shape[-1]]:
            continue
        items = getitems(node)
        if len(items) != len(node.users):
            continue
        if edit.replace(layer_norm_fwd, (x, w, b, float(eps)), {}, items, [node, *items.values()]):
            count += 1
    return count


def layer_norm_backward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not is_call(node, aten.native_layer_norm_backward.default):
            continue
        dy, x, shape, mean, rstd, w, b, mask = node.args
        # all three gradients, or dx alone: a frozen weight and bias (LoRA, freeze), whose kernel skips
        # the dw and db sums; the other masks (one of w and b trained, or no dx) stay eager
        weight_grad = list(mask) == [True, True, True]
        if (w is None or b is None or list(shape) != [val(x).shape[-1]]
                or not (weight_grad or list(mask) == [True, False, False])):
            continue
        items = getitems(node)
        if len(items) != len(node.users):
            continue
        if edit.replace(layer_norm_bwd, (dy, x, w, mean, rstd, weight_grad), {}, items, [node, *items.values()]):
            count += 1
    return count
