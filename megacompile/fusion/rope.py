"""Rotary embeddings onto kernels/rope.py: HF's apply_rotary_pos_emb, forward and backward.

    forward   y = x * cos + cat([-x[..., h:], x[..., :h]], -1) * sin              (rotate_half)
    backward  dx = slice_backward(-(dy * sin)[..., :h], at h:) + slice_backward((dy * sin)[..., h:], at :h)
                   + dy * cos                                                      (the rotation by -theta)

x is [B, H, S, D] in any layout with a unit stride on D (HF's view + transpose is read in place);
cos and sin are [S, D], [B, S, D] or [B, 1, S, D]. One kernel node per rotated tensor (q and k
each), since the graph rotates them separately.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph import GraphEdit, alive
from .launchers import rope_bwd, rope_fwd
from .match import ANY, Const, Op, Var, equals, is_call, matches, val

aten = torch.ops.aten
INT = Const(lambda v: isinstance(v, int) and not isinstance(v, bool))


def _int(name: str) -> Const:
    return Const(lambda v: isinstance(v, int) and not isinstance(v, bool), name)


ROTATE_HALF = Op(aten.cat.default,
                 [Op(aten.neg.default, Op(aten.slice.Tensor, Var("x"), _int("d1"), _int("s1"), _int("e1"))),
                  Op(aten.slice.Tensor, Var("x"), _int("d2"), _int("s2"), _int("e2"))],
                 _int("dc"))
ROPE = Op(aten.add.Tensor, Op(aten.mul.Tensor, Var("x"), Var("cos")), Op(aten.mul.Tensor, ROTATE_HALF, Var("sin")),
          name="y")

_DY_SIN = Op(aten.mul.Tensor, Var("dy"), Var("sin"), name="dy_sin")
ROPE_BACKWARD = Op(
    aten.add.Tensor,
    Op(aten.add.Tensor,
       Op(aten.slice_backward.default,
          Op(aten.neg.default, Op(aten.slice.Tensor, _DY_SIN, _int("d1"), _int("s1"), _int("e1"))),
          ANY, _int("bd1"), _int("bs1"), _int("be1"), Const(equals(1))),
       Op(aten.slice_backward.default, Op(aten.slice.Tensor, _DY_SIN, _int("d2"), _int("s2"), _int("e2")),
          ANY, _int("bd2"), _int("bs2"), _int("be2"), Const(equals(1)))),
    Op(aten.mul.Tensor, Var("dy"), Var("cos")),
    name="dx")


def _last(d: int, ndim: int) -> bool:
    return d in (-1, ndim - 1)


def _tables_fit(x: fx.Node, cos: fx.Node, sin: fx.Node) -> bool:
    """cos, sin [S, D], [B|1, S, D] or [B|1, 1, S, D] for x [B, H, S, D], one shape and dtype."""
    t, c, s = val(x), val(cos), val(sin)
    if c.shape != s.shape or c.dtype != s.dtype or t.dim() != 4 or t.stride(-1) != 1 or t.shape[-1] % 2:
        return False
    if c.dim() == 4 and c.shape[1] != 1:
        return False
    if c.dim() not in (2, 3, 4) or tuple(c.shape[-2:]) != tuple(t.shape[-2:]):
        return False
    return c.dim() == 2 or c.shape[0] in (1, t.shape[0])


def rope_forward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.add.Tensor):
            continue
        for b in matches(ROPE, node):
            x, ndim = b["x"], val(b["x"]).dim()
            d, h = val(x).shape[-1], val(x).shape[-1] // 2
            if not (_last(b["d1"], ndim) and _last(b["d2"], ndim) and _last(b["dc"], ndim)
                    and (b["s1"], b["e1"] >= d) == (h, True) and (b["s2"], b["e2"]) == (0, h)
                    and _tables_fit(x, b["cos"], b["sin"]) and val(node).shape == val(x).shape):
                continue
            if edit.replace(rope_fwd, (x, b["cos"], b["sin"]), {}, {0: node}, b.nodes):
                count += 1
                break
    return count


def rope_backward(edit: GraphEdit) -> int:
    count = 0
    for node in list(edit.graph.nodes):
        if not alive(node) or not is_call(node, aten.add.Tensor):
            continue
        for b in matches(ROPE_BACKWARD, node):
            dy, ndim = b["dy"], val(b["dy"]).dim()
            d, h = val(dy).shape[-1], val(dy).shape[-1] // 2
            dims = (b["d1"], b["d2"], b["bd1"], b["bd2"])
            if not (all(_last(x, ndim) for x in dims)
                    and (b["s1"], b["e1"]) == (0, h) and (b["bs1"], b["be1"] >= d) == (h, True)
                    and (b["s2"], b["e2"] >= d) == (h, True) and (b["bs2"], b["be2"]) == (0, h)
                    and _tables_fit(dy, b["cos"], b["sin"]) and val(node).shape == val(dy).shape):
                continue
            if edit.replace(rope_bwd, (dy, b["cos"], b["sin"]), {}, {0: node}, b.nodes):
                count += 1
                break
    return count
