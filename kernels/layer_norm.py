"""LayerNorm with weight and bias: y = (x - mean(x)) * rsqrt(var(x) + eps) * w + b.

Statistics and the affine map are computed in fp32; y is stored in x.dtype. For x of M rows and N
columns in a dtype of b bytes:
  forward  reads M*N*b (x) + 2*N*b_w (w, b), writes M*N*b (y) + 8*M (mean, rstd for backward);
  backward reads 2*M*N*b (dy, x) + 8*M + N*b_w, writes M*N*b (dx) + 8*P*N (dw and db partials, one
  fp32 row each per program, P = SM count) - x is read once, dw and db are reduced from the partials.
  A frozen weight and bias (LoRA, freeze) take no gradient: WEIGHT_GRAD=False writes dx alone, no partials.
The variance is the biased one (divide by N), as torch.nn.functional.layer_norm uses.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import as_rows, persistent_programs, row_tile
from . import outputs


@triton.jit
def layer_norm_forward_kernel(
    y_ptr,  # *T [M, N] output, rows y_row_stride apart
    x_ptr,  # *T [M, N] input, rows x_row_stride apart
    w_ptr,  # *Tw [N] weight
    b_ptr,  # *Tw [N] bias
    mean_ptr,  # *fp32 [M] out: row means, saved for backward
    rstd_ptr,  # *fp32 [M] out: 1 / sqrt(var + eps), saved for backward
    y_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # >= n_cols: a program holds whole rows
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]

    x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padding columns must not enter the variance
    rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def layer_norm_backward_kernel(
    dx_ptr,  # *T [M, N] out: gradient of x
    dy_ptr,  # *T [M, N] gradient of y
    x_ptr,  # *T [M, N] forward input
    w_ptr,  # *Tw [N] weight
    mean_ptr,  # *fp32 [M] saved by the forward
    rstd_ptr,  # *fp32 [M] saved by the forward
    dw_partial_ptr,  # *fp32 [P, N] out: this program's sum over its rows of dy * x_hat (if WEIGHT_GRAD)
    db_partial_ptr,  # *fp32 [P, N] out: this program's sum over its rows of dy (if WEIGHT_GRAD)
    dx_row_stride,
    dy_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    WEIGHT_GRAD: tl.constexpr,  # False: w and b are frozen, the partials are neither read nor written
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Persistent: P programs stride over the row blocks, each keeping dw, db partials in registers.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        # dx = rstd * (w*dy - mean(w*dy) - x_hat * mean(w*dy*x_hat))
        c1 = tl.sum(wdy * x_hat, axis=1) / n_cols
        c2 = tl.sum(wdy, axis=1) / n_cols
        dx = (wdy - (x_hat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dw += tl.sum(dy * x_hat, axis=0)
            db += tl.sum(dy, axis=0)
    if WEIGHT_GRAD:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_mask)
        tl.store(db_partial_ptr + pid * n_cols + cols, db, mask=col_mask)


def layer_norm_forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float):
    """(y [..., N] in x.dtype, mean [M] fp32, rstd [M] fp32) for x [..., N], w and b [N]."""
    shape = x.shape
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    y = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    mean = outputs.empty((n_rows,), dtype=torch.float32, device=x.device)
    rstd = outputs.empty((n_rows,), dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    layer_norm_forward_kernel[(triton.cdiv(n_rows, block_m),)](
        y, x2, w, b, mean, rstd, y.stride(0), x2.stride(0), n_rows, n_cols, eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y.view(shape), mean, rstd


def layer_norm_backward(dy, x, w, mean, rstd, weight_grad: bool = True):
    """(dx [..., N] in x.dtype, dw [N] and db [N] in w.dtype); weight_grad=False (w and b frozen):
    (dx, None, None)."""
    shape = x.shape
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    programs = persistent_programs(x.device, triton.cdiv(n_rows, block_m))
    partials = programs if weight_grad else 0
    dw_partial = torch.empty((partials, n_cols), dtype=torch.float32, device=x.device)
    db_partial = torch.empty((partials, n_cols), dtype=torch.float32, device=x.device)
    layer_norm_backward_kernel[(programs,)](
        dx, dy2, x2, w, mean, rstd, dw_partial, db_partial, dx.stride(0), dy2.stride(0), x2.stride(0),
        n_rows, n_cols, WEIGHT_GRAD=weight_grad, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    if not weight_grad:
        return dx.view(shape), None, None
    return dx.view(shape), dw_partial.sum(0).to(w.dtype), db_partial.sum(0).to(w.dtype)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, eps):
        y, mean, rstd = layer_norm_forward(x, w, b, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        # one flag for both sums: where w alone or b alone is frozen, both are made
        dx, dw, db = layer_norm_backward(dy, x, w, mean, rstd, weight_grad=any(ctx.needs_input_grad[1:3]))
        return dx, dw, db, None


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Fused LayerNorm over the last dim of x; differentiable in x, w and b."""
    return LayerNormFunction.apply(x, w, b, eps)
