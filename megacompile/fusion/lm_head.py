"""What the two fused heads of the lm head share: the loss's cross-entropy and the post-training
losses' log-probabilities both make dW [V, H] fp32 from [chunk, V] tiles, and both end their
backward group at the head's two gradient matmuls."""
from __future__ import annotations

import torch
import torch.fx as fx

from .contract import StagePair
from .match import is_call, peel, single_user

aten = torch.ops.aten

# addmm(..., out_dtype=float32) over bf16 operands: cuda only, in torch 2.8 and later.
FP32_OUT_GEMM = "dtype_out" in torch.ops.aten.addmm.overloads()


# -- launchers ----------------------------------------------------------------------------------
def dw_rows(chunk_size: int, n: int, vocab: int) -> int:
    """Vocab rows per dW partial product when dW is fp32 and the product is not: the [rows, H]
    partial in h.dtype is a declared output, as large as a chunk of dh, never a [V, H] temporary."""
    return min(vocab, chunk_size, n)


def accumulate_dw(dw: torch.Tensor, logits: torch.Tensor, h_chunk: torch.Tensor, partial: torch.Tensor) -> None:
    """dw [V, H] fp32 += logits.T @ h_chunk. Same dtypes: one addmm. bf16 operands on cuda: one
    cuBLAS GEMM that accumulates in fp32 and adds into dw (addmm's out_dtype). Elsewhere the product
    goes through the [rows, H] partial in h.dtype, rows of the vocabulary at a time: on a GPU that
    loop is V / rows small GEMMs per chunk (63 at a 32k vocabulary), launch-bound."""
    if dw.dtype == logits.dtype:
        dw.addmm_(logits.T, h_chunk)
    elif logits.is_cuda and FP32_OUT_GEMM:
        torch.addmm(dw, logits.T, h_chunk, out_dtype=torch.float32, out=dw)
    else:
        rows = partial.shape[0]
        for v in range(0, dw.shape[0], rows):                        # product in h.dtype, sum in fp32
            part = partial[:min(rows, dw.shape[0] - v)]
            torch.mm(logits[:, v:v + rows].T, h_chunk, out=part)
            dw[v:v + rows] += part                                   # casts as it adds: no fp32 copy


# -- matching -----------------------------------------------------------------------------------
def is_transpose_of(x: fx.Node, w: fx.Node, times: int) -> bool:
    """x is w under `times` transposes (and any detach/alias between)."""
    for _ in range(times):
        x = peel(x)
        if not is_call(x, aten.t.default):
            return False
        x = x.args[0]
    return peel(x) is w


def head_grads(pair: StagePair, dlogits: fx.Node, w_in: fx.Node, h: fx.Node, frozen: bool = False
               ) -> tuple[fx.Node, fx.Node | None, list[fx.Node]] | None:
    """(dh mm, dW mm, the transpose between) where the 2-d dlogits is read by exactly the lm head's
    two gradient matmuls: dh = dlogits @ W (W reaching the backward as w_in) and dW = dlogits.T @ h.
    frozen: a head W that takes no gradient (LoRA, a frozen head), dlogits read by the dh matmul
    alone; (dh mm, None, [])."""
    dh = dw = None
    transposes = []
    for u in dlogits.users:
        if is_call(u, aten.mm.default) and u.args[0] is dlogits and is_transpose_of(u.args[1], w_in, 2):
            dh = u
        elif is_call(u, aten.t.default) and single_user(u):
            (v,) = u.users
            if is_call(v, aten.mm.default) and v.args[0] is u and pair.forward_of(v.args[1]) is h:
                dw, transposes = v, [u]
    if frozen:
        return (dh, None, []) if dh is not None and len(dlogits.users) == 1 else None
    if dh is None or dw is None or len(dlogits.users) != 2:
        return None
    return dh, dw, transposes
