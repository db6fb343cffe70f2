"""The Triton attention (kernels/attention.py): against eager attention in fp32 and bf16, as a stand-in
for torch's flash ops (the same o and log-sum-exp, a backward that takes theirs), and writing into
the tensors its caller laid out. test_gpu_compile.py compiles it in the tiles each target launches."""
import pytest
import torch

from megacompile.kernels import outputs
from megacompile.kernels.attention import attention, attention_backward, attention_forward, heads_layout
from megacompile.kernels.check import TOLERANCE, compare_autograd
from megacompile.kernels.reference import attention_ref

aten = torch.ops.aten


def _qkv(batch, hq, hkv, seq, dim, dtype=torch.float32, seed=0):
    """q, k, v as HF makes them: [B, S, H, D] projections viewed [B, H, S, D]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, seq, h, dim, generator=gen).to(dtype).transpose(1, 2) for h in (hq, hkv, hkv)]


GQA = (1, 6, 2, 33, 24)      # 3 query heads per key/value head, a length and a head dim no tile divides


@pytest.mark.parametrize("shape,causal,dtype", [
    (GQA, True, torch.float32), (GQA, False, torch.float32), (GQA, True, torch.bfloat16),
    (GQA, False, torch.bfloat16),
    ((2, 4, 4, 21, 16), True, torch.float32),       # one head per key/value head, two rows
    ((1, 4, 1, 5, 40), False, torch.bfloat16),      # four query heads on one key/value head, 5 tokens
])
def test_attention_matches_eager(shape, causal, dtype):
    q, k, v = _qkv(*shape, dtype=dtype)
    fwd, bwd = compare_autograd(lambda q, k, v: attention(q, k, v, causal, 0.3),
                                lambda q, k, v: attention_ref(q, k, v, causal, 0.3), (q, k, v), (0, 1, 2))
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_results_and_saved_values_are_those_of_torchs_flash_op():
    """o and lse equal what the fused-SDPA op makes (the CPU one here; the GPU ones keep the same
    layouts and meanings), and the backward fed that op's own o and lse equals its backward: the
    fusion pass may replace the forward, the backward, or both."""
    q, k, v = _qkv(2, 4, 2, 19, 16, seed=1)
    do = torch.randn(2, 19, 4, 16, generator=torch.Generator().manual_seed(2)).transpose(1, 2)
    o_ref, lse_ref = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.25)
    grads_ref = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o_ref, lse_ref, 0.0, True,
                                                                          scale=0.25)
    o, lse = attention_forward(q, k, v, True, 0.25, o_ref.stride(), lse_ref.stride())
    assert o.stride() == o_ref.stride() and lse.stride() == lse_ref.stride()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-6)
    grads = attention_backward(do, q, k, v, o_ref, lse_ref, True, 0.25)[:3]
    for got, want in zip(grads, grads_ref, strict=True):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_results_go_where_the_caller_laid_them_out():
    """Inside outputs.into the kernels write into the given tensors (the device arena's), delta included."""
    q, k, v = _qkv(1, 4, 2, 9, 16)
    layout = heads_layout(1, 4, 9, 16)
    given = [torch.empty_strided(q.shape, layout), torch.empty(1, 4, 9)]
    with outputs.into(given):
        o, lse = attention_forward(q, k, v, True)
    assert o.data_ptr() == given[0].data_ptr() and lse.data_ptr() == given[1].data_ptr()
    kv_layout = heads_layout(1, 2, 9, 16)
    given = [torch.empty(1, 4, 9), torch.empty_strided(q.shape, layout), torch.empty_strided(k.shape, kv_layout),
             torch.empty_strided(k.shape, kv_layout)]
    with outputs.into(given):
        results = attention_backward(torch.ones_like(o), q, k, v, o, lse, True)
    assert [t.data_ptr() for t in results] == [t.data_ptr() for t in given[1:]] + [given[0].data_ptr()]
