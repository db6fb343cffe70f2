"""SwiGLU, GELU and softmax onto kernels/swiglu.py, kernels/gelu.py and kernels/softmax.py.

    SwiGLU   forward  silu(gate) * up
             backward silu_backward(dc * up, gate), dc * silu(gate)
    GELU     forward  gelu(x[, approximate])
             backward gelu_backward(dy, x[, approximate])
             or HF's NewGELUActivation, decomposed:
                      0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
                      with autograd's backward through tanh_backward (dy * 0.5x, tanh) and the chain rule
    softmax  forward  _softmax(x, -1) (eager attention); its backward stays ATen (it reads y, the
                      kernel's backward reads x)

A backward group that reads a saved value it cannot see computed (silu(gate), tanh(...)) is checked
against the forward node that made it (StagePair.holds), so the rewrite is exact, not a guess.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .contract import StagePair
from .graph import GraphEdit, alive
from .launchers import gelu_bwd, gelu_fwd, softmax_fwd, swiglu_bwd, swiglu_fwd
from .match import Const, Op, Var, close_to, equals, first_match, is_call, matches, val

aten = torch.ops.aten
MUL = {aten.mul.Tensor, aten.mul.Scalar}
POW = aten.pow.Tensor_Scalar
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _same(*nodes: fx.Node) -> bool:
    """One floating shape and dtype: what the elementwise kernels take."""
    first = val(nodes[0])
    return first.dtype.is_floating_point and all(val(n).shape == first.shape and val(n).dtype == first.dtype
                                                 for n in nodes)


# -- SwiGLU -------------------------------------------------------------------------------------
SILU = Op(aten.silu.default, Var("a"))
SWIGLU = Op(aten.mul.Tensor, Op(aten.silu.default, Var("a"), name="silu"), Var("b"), name="c")
SWIGLU_DA = Op(aten.silu_backward.default, Op(aten.mul.Tensor, Var("dc"), Var("b")), Var("a"), name="da")
SWIGLU_DB = Op(aten.mul.Tensor, Var("dc"), Var("s"), name="db")


def swiglu_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.mul.Tensor):
            continue
        b = first_match(SWIGLU, node)
        if b is None or not _same(b["a"], b["b"], b["c"]):
            continue
        if edit.replace(swiglu_fwd, (b["a"], b["b"]), {}, {0: b["c"]}, b.nodes):
            count += 1
    return count


def swiglu_backward(pair: StagePair) -> int:
    edit, count = pair.bwd, 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.silu_backward.default):
            continue
        for m in matches(SWIGLU_DA, node):
            dc, a, b = m["dc"], m["a"], m["b"]
            db = next((u for u in dc.users if u not in m.nodes and _is_db(pair, u, dc, a)), None)
            if db is None or not _same(dc, a, b):
                continue
            if edit.replace(swiglu_bwd, (dc, a, b), {}, {0: node, 1: db}, [*m.nodes, db]):
                count += 1
                break
    return count


def _is_db(pair: StagePair, node: fx.Node, dc: fx.Node, a: fx.Node) -> bool:
    """node is dc * silu(a): silu computed here, or saved by the forward from a's forward value."""
    b = first_match(SWIGLU_DB, node, {"dc": dc})
    return b is not None and pair.holds(SILU, b["s"], {"a": a})


# -- GELU ---------------------------------------------------------------------------------------
_CUBIC = Op(MUL, Op(POW, Var("x"), Const(equals(3))), Const(close_to(0.044715)))
TANH_INNER = Op(aten.tanh.default,
                Op(MUL, Op(aten.add.Tensor, Var("x"), _CUBIC), Const(close_to(SQRT_2_OVER_PI))),
                name="tanh")
HALF_X = Op(MUL, Var("x"), Const(equals(0.5)), name="half")
ONE_PLUS = Op(aten.add.Tensor, TANH_INNER, Const(equals(1)), name="onep")
GELU_TANH = Op(aten.mul.Tensor, HALF_X, ONE_PLUS, name="y")

_TB_C = Op(MUL, Op(aten.tanh_backward.default, Op(aten.mul.Tensor, Var("dy"), Var("half")), Var("t")),
           Const(close_to(SQRT_2_OVER_PI)), name="tbc")
GELU_TANH_BACKWARD = Op(
    aten.add.Tensor,
    Op(aten.add.Tensor, _TB_C,
       Op(aten.mul.Tensor, Op(MUL, _TB_C, Const(close_to(0.044715))),
          Op(MUL, Op(POW, Var("x"), Const(equals(2))), Const(equals(3))))),
    Op(MUL, Op(aten.mul.Tensor, Var("dy"), Var("onep")), Const(equals(0.5))),
    name="dx")


def gelu_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node):
            continue
        if is_call(node, aten.gelu.default) and _same(node.args[0]):
            approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            done = edit.replace(gelu_fwd, (node.args[0], approximate), {}, {0: node}, [node])
        elif is_call(node, aten.mul.Tensor) and (b := first_match(GELU_TANH, node)) is not None:
            if not _same(b["x"], node):
                continue
            done = edit.replace(gelu_fwd, (b["x"], "tanh"), {}, {0: node}, b.nodes)
        else:
            continue
        count += bool(done)
    return count


def gelu_backward(pair: StagePair) -> int:
    edit, count = pair.bwd, 0
    for node in list(edit.graph.nodes):
        if not alive(node):
            continue
        if is_call(node, aten.gelu_backward.default) and _same(node.args[0], node.args[1]):
            approximate = node.kwargs.get("approximate", node.args[2] if len(node.args) > 2 else "none")
            done = edit.replace(gelu_bwd, (node.args[0], node.args[1], approximate), {}, {0: node}, [node])
        elif is_call(node, aten.add.Tensor) and (b := first_match(GELU_TANH_BACKWARD, node)) is not None:
            x = b["x"]
            exact = (pair.holds(HALF_X, b["half"], {"x": x}) and pair.holds(TANH_INNER, b["t"], {"x": x})
                     and pair.holds(Op(aten.add.Tensor, Var("t"), Const(equals(1))), b["onep"], {"t": b["t"]}))
            if not exact or not _same(b["dy"], x, node):
                continue
            done = edit.replace(gelu_bwd, (b["dy"], x, "tanh"), {}, {0: node}, b.nodes)
        else:
            continue
        count += bool(done)
    return count


# -- softmax ------------------------------------------------------------------------------------
def softmax_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not is_call(node, aten._softmax.default):
            continue
        x, dim, half_to_float = node.args
        t = val(x)
        if half_to_float or dim not in (-1, t.dim() - 1) or not t.is_contiguous() or not _same(x, node):
            continue
        if edit.replace(softmax_fwd, (x,), {}, {0: node}, [node]):
            count += 1
    return count
