"""Row softmax over the last dim, optionally scaled and causally masked, for attention scores
x [..., Q, K]:  y = softmax(scale * x) with entries k > q set to 0 when causal (the top-left aligned
mask of torch's scaled_dot_product_attention(is_causal=True)).

Computed in fp32, stored in x.dtype. The backward saves the scores, not the probabilities, and
recomputes y in fp32: dx = scale * y * (dy - sum(dy * y)) cancels badly when y comes back rounded
to bf16 (a row dominated by one entry loses its gradient), and x costs the same bytes to keep.
For n elements of b bytes (masked entries are never read; a causal square halves the reads):
  forward  reads n*b, writes n*b (eager masked softmax also writes and rereads the masked scores);
  backward reads 2*n*b (dy, x), writes n*b.
A program holds whole rows (K up to ~64K columns).
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import as_rows, row_tile
from . import outputs


@triton.jit
def _probabilities(x_ptr, rows, cols, x_row_stride, n_rows, n_cols, n_queries, scale, CAUSAL: tl.constexpr):
    """fp32 softmax of scale * x over whole rows (0 where masked or padding) and the in-bounds mask."""
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    keep = mask
    if CAUSAL:
        keep = keep & (cols[None, :] <= (rows % n_queries)[:, None])
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + cols[None, :], mask=keep, other=0.0)
    z = tl.where(keep, x.to(tl.float32) * scale, float("-inf"))
    z_max = tl.max(z, axis=1)
    z_max = tl.where(z_max == float("-inf"), 0.0, z_max)  # padding rows have nothing to keep
    e = tl.exp(z - z_max[:, None])  # 0 where masked
    denom = tl.sum(e, axis=1)
    return e / tl.where(denom == 0.0, 1.0, denom)[:, None], mask


@triton.jit
def softmax_forward_kernel(
    y_ptr,  # *T [M, K] out: probabilities, M = prod(leading dims) * Q
    x_ptr,  # *T [M, K] scores
    y_row_stride,
    x_row_stride,
    n_rows,
    n_cols,  # K
    n_queries,  # Q: row r holds query r % Q
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # >= K
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    y, mask = _probabilities(x_ptr, rows, cols, x_row_stride, n_rows, n_cols, n_queries, scale, CAUSAL)
    y_off = rows.to(tl.int64)[:, None] * y_row_stride + cols[None, :]
    tl.store(y_ptr + y_off, round_to(y, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_backward_kernel(
    dx_ptr,  # *T [M, K] out: gradient of the scores (0 where masked)
    dy_ptr,  # *T [M, K] gradient of the probabilities
    x_ptr,  # *T [M, K] scores saved by the forward; y is recomputed from them in fp32
    dx_row_stride,
    dy_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    n_queries,
    scale,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    y, mask = _probabilities(x_ptr, rows, cols, x_row_stride, n_rows, n_cols, n_queries, scale, CAUSAL)
    rows64 = rows.to(tl.int64)[:, None]
    dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask & (y > 0.0), other=0.0).to(tl.float32)
    dot = tl.sum(dy * y, axis=1)
    dx = (y * (dy - dot[:, None])) * scale
    tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)


def softmax_forward(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    shape = x.shape
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    n_queries = shape[-2] if x.dim() >= 2 else 1
    y = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    softmax_forward_kernel[(triton.cdiv(n_rows, block_m),)](
        y, x2, y.stride(0), x2.stride(0), n_rows, n_cols, n_queries, scale,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y.view(shape)


def softmax_backward(dy: torch.Tensor, x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    shape = x.shape
    dy2, x2 = as_rows(dy), as_rows(x)
    n_rows, n_cols = x2.shape
    n_queries = shape[-2] if x.dim() >= 2 else 1
    dx = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    softmax_backward_kernel[(triton.cdiv(n_rows, block_m),)](
        dx, dy2, x2, dx.stride(0), dy2.stride(0), x2.stride(0), n_rows, n_cols, n_queries, scale,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx.view(shape)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, causal):
        ctx.save_for_backward(x)
        ctx.scale, ctx.causal = scale, causal
        return softmax_forward(x, scale, causal)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return softmax_backward(dy, x, ctx.scale, ctx.causal), None, None


def softmax(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    """softmax(scale * x, dim=-1), masked to k <= q when causal; differentiable in x."""
    return SoftmaxFunction.apply(x, scale, causal)
