"""Grouped GEMM of a mixture-of-experts layer, for GPUs where torch._grouped_mm does not run
(float32 anywhere, bf16 before sm_90).

Rows of x are sorted by expert and offs[e] is where expert e's rows end:
    forward      y[rows_e] = x[rows_e] @ w[e]            x [S, K], w [E, K, N] -> y [S, N]
    input grad   dx[rows_e] = dy[rows_e] @ w[e]^T        the same kernel on the view w.transpose(-2, -1)
    weight grad  dw[e] = x[rows_e]^T @ dy[rows_e]        [E, K, N]: the rows are the contraction
Bytes, b per element: the forward reads S*K*b of x once per N tile and E*K*N*b of w once per row
tile of its expert, writes S*N*b; the weight gradient reads x and dy once per (K, N) tile and writes
E*K*N*b. An expert with no rows costs its programs one early exit (and gets a zero gradient).

The grid is (E, cdiv(S, BLOCK_M), N tiles): program (e, m) takes row tile m of expert e's rows and
exits when expert e has fewer rows; the host never reads the offsets (no sync). Accumulation is
float32; float32 inputs multiply in IEEE float32 (no tf32). Under the interpreter a bf16 tl.dot
returns garbage, so there the tiles are widened to float32 first (UPCAST).
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from . import outputs

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32


@triton.jit
def _dot_into(acc, a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        acc += tl.dot(a, b, input_precision="ieee")
    else:
        acc += tl.dot(a, b)
    return acc


@triton.jit
def grouped_gemm_kernel(
    y_ptr,  # *T [S, N] out, rows grouped by expert
    x_ptr,  # *T [S, K] rows grouped by expert
    w_ptr,  # *T [E, K, N] any strides (a transposed view for the input gradient)
    offs_ptr,  # *i32 [E] end of each expert's rows
    K, N,
    stride_xs, stride_xk, stride_we, stride_wk, stride_wn, stride_ys, stride_yn,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.where(e > 0, tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(offs_ptr + e)
    row0 = start + tl.program_id(1) * BLOCK_M
    if row0 < end:
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xs + ks[None, :] * stride_xk,
                        mask=(rows[:, None] < end) & (ks[None, :] < K), other=0.0)
            b = tl.load(w_ptr + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                        mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
            acc = _dot_into(acc, a, b, UPCAST, IEEE)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ys + cols[None, :] * stride_yn,
                 round_to(acc, y_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N))


@triton.jit
def grouped_gemm_weight_grad_kernel(
    dw_ptr,  # *T [E, K, N] out, contiguous
    x_ptr,  # *T [S, K] rows grouped by expert
    dy_ptr,  # *T [S, N] rows grouped by expert
    offs_ptr,  # *i32 [E] end of each expert's rows
    K, N,
    stride_xs, stride_xk, stride_ys, stride_yn,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e = tl.program_id(0)
    start = tl.where(e > 0, tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(offs_ptr + e)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for row0 in range(start, end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        a = tl.load(x_ptr + rows[None, :].to(tl.int64) * stride_xs + ks[:, None] * stride_xk,
                    mask=(rows[None, :] < end) & (ks[:, None] < K), other=0.0)       # x^T tile [BK, BM]
        b = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_ys + cols[None, :] * stride_yn,
                    mask=(rows[:, None] < end) & (cols[None, :] < N), other=0.0)     # [BM, BN]
        acc = _dot_into(acc, a, b, UPCAST, IEEE)
    tl.store(dw_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :],
             round_to(acc, dw_ptr.dtype.element_ty), mask=(ks[:, None] < K) & (cols[None, :] < N))


def _modes(dtype: torch.dtype) -> tuple[bool, bool]:
    interpret = bool(triton.knobs.runtime.interpret)
    return interpret or dtype == torch.float32, dtype == torch.float32


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K] grouped by expert, w [E, K, N] (any strides), offs [E] -> [S, N]."""
    rows, k = x.shape
    experts, _, n = w.shape
    y = outputs.zeros((rows, n), dtype=x.dtype, device=x.device)    # rows past offs[-1] stay zero
    if rows and n:
        upcast, ieee = _modes(x.dtype)
        grid = (experts, triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
        grouped_gemm_kernel[grid](y, x, w, offs.to(torch.int32), k, n, x.stride(0), x.stride(1), w.stride(0),
                                  w.stride(1), w.stride(2), y.stride(0), y.stride(1), UPCAST=upcast, IEEE=ieee,
                                  BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return y


def grouped_gemm_weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K], dy [S, N], both grouped by expert, offs [E] -> dw [E, K, N]."""
    k, n = x.size(1), dy.size(1)
    experts = offs.size(0)
    dw = outputs.empty((experts, k, n), dtype=x.dtype, device=x.device)
    if dw.numel():
        upcast, ieee = _modes(x.dtype)
        grid = (experts, triton.cdiv(k, BLOCK_K), triton.cdiv(n, BLOCK_N))
        grouped_gemm_weight_grad_kernel[grid](dw, x, dy, offs.to(torch.int32), k, n, x.stride(0), x.stride(1),
                                              dy.stride(0), dy.stride(1), UPCAST=upcast, IEEE=ieee,
                                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return dw


class GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return grouped_gemm(x, w, offs)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        return grouped_gemm(dy, w.transpose(-2, -1), offs), grouped_gemm_weight_grad(x, dy, offs), None


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Differentiable in x and w: y[rows_e] = x[rows_e] @ w[e]."""
    return GroupedGemmFunction.apply(x, w, offs)
