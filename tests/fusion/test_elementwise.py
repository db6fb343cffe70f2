"""Generated elementwise kernels: the values eager computes, one kernel per chain, one compile per
distinct chain, inputs that broadcast, eager's bf16 roundings, and what is left alone."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.fusion.elementwise import ElementwiseKernel, fuse_elementwise
from megacompile.fusion.graph import GraphEdit

aten = torch.ops.aten


def fused(fn, *inputs):
    """fn traced to ATen with fake values, its elementwise chains fused; (module, kernel nodes)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    edit = GraphEdit(gm)
    fuse_elementwise(edit)
    edit.dce()
    gm.recompile()
    return gm, edit.kernels


def many_ops(x, y):
    a = torch.tanh(x * 0.5 + y) * torch.sigmoid(y) - torch.exp(-x.abs()) / (1.0 + y * y)
    b = torch.rsqrt(x * x + 1.0) + torch.sqrt(y * y + 2.0) + x.pow(3) - 0.25 * torch.sin(x) * torch.cos(y)
    c = torch.where(x > 0.1, torch.nn.functional.silu(x), torch.relu(y)) + torch.erf(x) + torch.log(y * y + 1.0)
    return a + b * c, torch.maximum(a, b) - torch.minimum(b, c)


def test_a_chain_of_many_ops_becomes_one_kernel_and_matches_eager():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(37, 129, generator=g) * 3, torch.randn(37, 129, generator=g)
    x[0, :8] = torch.tensor([0.0, 1e-4, -1e-4, 0.05, -0.05, 20.0, -20.0, 0.1])   # tanh's series / far tails
    gm, kernels = fused(many_ops, x, y)
    assert len(kernels) == 1
    left = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert not left, f"left eager: {[n.target for n in left]}"
    for out, ref in zip(gm(x, y), many_ops(x, y)):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_broadcast_and_scalar_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 16, generator=g)
    b, c, s = torch.randn(16, generator=g), torch.randn(4, 1, 16, generator=g), torch.tensor(0.7)
    wide = torch.randn(16, 8, generator=g).t()        # [8, 16], non-contiguous: read through its strides

    def fn(x, b, c, s, wide):
        return torch.exp((x * b + c) * s) - wide

    gm, kernels = fused(fn, x, b, c, s, wide)
    assert len(kernels) == 1 and kernels[0].target.kinds == ["flat", "strided", "strided", "scalar", "strided"]
    torch.testing.assert_close(gm(x, b, c, s, wide), fn(x, b, c, s, wide), rtol=1e-6, atol=1e-6)


def test_bf16_chain_rounds_where_eager_rounds():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(3, 1000, generator=g).bfloat16(), torch.randn(3, 1000, generator=g).bfloat16()

    def fn(x, y):
        return ((x * 0.3 + y) * 1.7 - x).float() * 2.0 - 1.0, (x + y).to(torch.bfloat16)

    gm, kernels = fused(fn, x, y)
    assert len(kernels) == 1
    for out, ref in zip(gm(x, y), fn(x, y)):
        assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_one_compile_per_distinct_chain():
    def fn(x, y):
        return (x * y + 1.0).exp()

    def other(x, y):
        return (x * y + 2.0).exp()

    _, a = fused(fn, torch.randn(4, 4), torch.randn(4, 4))
    _, b = fused(fn, torch.randn(37, 129), torch.randn(37, 129))      # another shape: the same source
    _, c = fused(other, torch.randn(4, 4), torch.randn(4, 4))
    assert isinstance(a[0].target, ElementwiseKernel)
    assert a[0].target is b[0].target and a[0].target is not c[0].target
    assert "129" not in a[0].target.source and "2.0" in c[0].target.source


def test_single_ops_and_non_contiguous_results_stay_eager():
    def single(x, y):
        return torch.mm(x + y, y)

    def transposed(x, y):
        return (x.t() * 2.0).exp()          # the product keeps x.t()'s layout: not contiguous

    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for fn in (single, transposed):
        gm, kernels = fused(fn, x, y)
        assert not kernels
        torch.testing.assert_close(gm(x, y), fn(x, y))
