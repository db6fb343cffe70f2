"""The attention rewrite (fusion/attention.py) over the flash ops a GPU capture holds and the CPU
ones, and what it must leave alone.

A GPU graph is traced here with fake tensors (the GPU flash ops have meta kernels), rewritten, and
then run on host tensors: the kernels run under the interpreter, the answer is the CPU flash op's.
"""
from __future__ import annotations

import operator

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from megacompile.fusion.attention import attention_backward, attention_forward
from megacompile.fusion.graph import GraphEdit

aten = torch.ops.aten
SCALE = 0.3


def _qkv(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 11, h, 16, generator=gen).transpose(1, 2) for h in (4, 2, 2))
    return q, k, v, torch.randn(2, 11, 4, 16, generator=gen).transpose(1, 2)


def _gpu_step(q, k, v, do):
    """The forward and backward a GPU capture holds: the backward reads the forward's rng state
    and lengths."""
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=SCALE)
    grads = aten._scaled_dot_product_flash_attention_backward(do, q, k, v, r[0], r[1], r[2], r[3], r[4], r[5], 0.0,
                                                              True, r[6], r[7], scale=SCALE)
    return (r[0], r[1], *grads)


def _targets(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem}


def test_a_gpu_graph_is_rewritten_backward_first_and_computes_what_the_flash_ops_do():
    inputs = _qkv()
    edit = GraphEdit(make_fx(_gpu_step, tracing_mode="fake")(*inputs))
    assert attention_forward(edit) == 0, "the ATen backward still reads the forward's rng state"
    assert attention_backward(edit) == 1
    edit.dce()
    assert attention_forward(edit) == 1
    edit.dce()
    assert not _targets(edit.gm) & {aten._scaled_dot_product_flash_attention.default,
                                    aten._scaled_dot_product_flash_attention_backward.default}
    edit.gm.recompile()
    o, lse, dq, dk, dv = edit.gm(*inputs)
    q, k, v, do = inputs
    o_ref, lse_ref = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=SCALE)
    grads_ref = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o_ref, lse_ref, 0.0, True,
                                                                          scale=SCALE)
    for got, want in zip((o, lse, dq, dk, dv), (o_ref, lse_ref, *grads_ref), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the GPU op's layouts, which the graph's views were traced on
    fake = make_fx(_gpu_step, tracing_mode="fake")(*inputs)
    out_vals = [n.meta["val"] for n in fake.graph.output_node().args[0]]
    assert [t.stride() for t in (o, lse, dq, dk, dv)] == [t.stride() for t in out_vals]


def _cpu_forward(dropout=0.0):
    def step(q, k, v):
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout, True, scale=SCALE)
    return step


def _cpu_masked(q, k, v, mask):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=SCALE)


def test_what_the_kernel_does_not_compute_stays_aten():
    q, k, v, _ = _qkv()
    mask = torch.zeros(11, 11)
    cases = {
        "an attention mask": (_cpu_masked, (q, k, v, mask)),
        "dropout": (_cpu_forward(dropout=0.1), (q, k, v)),
        "a head dim read with a stride": (_cpu_forward(), (q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2))),
    }
    wide = [torch.zeros(2, 3, 32768, 16).transpose(1, 2) for _ in range(3)]     # 2 x 32768 heads of 3 tokens
    cases["more (batch x heads) than a grid's second axis holds"] = (_cpu_forward(), wide)
    for what, (fn, args) in cases.items():
        edit = GraphEdit(make_fx(fn, tracing_mode="fake")(*args))
        assert attention_forward(edit) == 0, what
    plain = GraphEdit(make_fx(_cpu_forward(), tracing_mode="fake")(q, k, v))
    assert attention_forward(plain) == 1


def test_a_backward_whose_gradient_the_kernel_cannot_read_stays_aten():
    """An upstream gradient read with a stride in the head dim (or a broadcast one) is not rewritten;
    the same backward with a plain one is."""
    def backward(q, k, v, do):
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=SCALE)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, True, scale=SCALE)
    q, k, v, do = _qkv()
    strided = do.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert attention_backward(GraphEdit(make_fx(backward, tracing_mode="fake")(q, k, v, strided))) == 0
    assert attention_backward(GraphEdit(make_fx(backward, tracing_mode="fake")(q, k, v, do))) == 1
