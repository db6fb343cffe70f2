"""dW of the fused lm heads: fp32 dW from bf16 tiles by rows of the vocabulary on the cpu (the
partial in h.dtype, summed in fp32) and, on cuda, by one fp32-output GEMM, whose call a stand-in
cuda tensor records here since no cpu build runs it."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megacompile.fusion import lm_head

aten = torch.ops.aten
N, H, V = 12, 8, 40


def _tiles(rows: int):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g).to(torch.bfloat16)
    h = torch.randn(N, H, generator=g).to(torch.bfloat16)
    start = torch.randn(V, H, generator=g)
    return logits, h, start, torch.empty(rows, H, dtype=torch.bfloat16)


def _by_rows(logits, h, rows):
    """Each block of vocabulary rows' product rounded to bf16 once, then summed in fp32."""
    return torch.cat([(logits[:, v:v + rows].T.float() @ h.float()).to(torch.bfloat16).float()
                      for v in range(0, V, rows)])


def test_the_partial_product_is_rounded_once_per_block_and_summed_in_fp32():
    rows = lm_head.dw_rows(chunk_size=7, n=N, vocab=V)
    assert rows == 7
    logits, h, start, partial = _tiles(rows)
    dw = start.clone()
    lm_head.accumulate_dw(dw, logits, h, partial)
    assert dw.dtype == torch.float32
    assert torch.equal(dw, start + _by_rows(logits, h, rows))


def test_same_dtypes_take_one_addmm():
    logits, h, start, _ = _tiles(0)
    logits, h = logits.float(), h.float()
    dw = start.clone()
    lm_head.accumulate_dw(dw, logits, h, torch.empty(0, H))
    torch.testing.assert_close(dw, start + logits.T @ h, rtol=1e-6, atol=1e-6)


class LooksCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


class FP32OutGemm(TorchDispatchMode):
    """Runs addmm's fp32-output overload as cuBLAS would (bf16 products, fp32 accumulation) and
    records each call; any other dW product is recorded too, so a fallback to the partial shows."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.addmm.dtype_out:
            dw, a, b, out_dtype = args
            self.calls.append((func, a.dtype, b.dtype, out_dtype, kwargs["out"] is dw))
            return kwargs["out"].copy_(dw + a.float() @ b.float())
        if func in (aten.mm.out, aten.mm.default):
            self.calls.append((func,))
        return func(*args, **kwargs)


def test_on_cuda_bf16_tiles_go_through_one_fp32_output_gemm_into_dw(monkeypatch):
    monkeypatch.setattr(lm_head, "FP32_OUT_GEMM", True)
    logits, h, start, partial = _tiles(lm_head.dw_rows(7, N, V))
    dw = start.clone()
    with FP32OutGemm() as gemm:
        lm_head.accumulate_dw(dw, logits.as_subclass(LooksCuda), h, partial)
    assert gemm.calls == [(aten.addmm.dtype_out, torch.bfloat16, torch.bfloat16, torch.float32, True)]
    torch.testing.assert_close(dw, start + logits.T.float() @ h.float(), rtol=1e-6, atol=1e-6)


def test_a_torch_without_the_fp32_output_gemm_falls_back_to_the_partial_on_cuda(monkeypatch):
    monkeypatch.setattr(lm_head, "FP32_OUT_GEMM", False)
    rows = lm_head.dw_rows(7, N, V)
    logits, h, start, partial = _tiles(rows)
    dw = start.clone()
    with FP32OutGemm() as gemm:
        lm_head.accumulate_dw(dw, logits.as_subclass(LooksCuda), h, partial)
    assert {c[0] for c in gemm.calls} == {aten.mm.out} and len(gemm.calls) == -(-V // rows)
    assert torch.equal(dw, start + _by_rows(logits, h, rows))
