"""RMSNorm as Llama and Qwen2 apply it: y = x * rsqrt(mean(x^2) + eps) * w.

Statistics and the product are computed in fp32; y is stored in x.dtype (bf16 rounded to nearest
even). For x of M rows and N columns in a dtype of b bytes:
  forward  reads M*N*b (x) + N*b_w (w), writes M*N*b (y) + 4*M (rstd, saved for backward);
  backward reads 2*M*N*b (dy, x) + 4*M (rstd) + N*b_w, writes M*N*b (dx) + 4*P*N (dw partials,
  one fp32 row per program, P = SM count) - x is read once, dw is reduced from the P partial rows.
  A frozen weight (LoRA) takes no gradient: WEIGHT_GRAD=False writes dx alone, no partials.
Eager PyTorch makes a full pass per elementwise op (square, mean, scale, weight) and as many again
in the backward.

HF's LlamaRMSNorm rounds the normalized x to the input dtype before multiplying by w; here the whole
product stays in fp32 and is rounded once, so bf16 results can differ from HF's by one bf16 ulp.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import as_rows, persistent_programs, row_tile
from . import outputs


@triton.jit
def rms_norm_forward_kernel(
    y_ptr,  # *T [M, N] output, rows y_row_stride apart
    x_ptr,  # *T [M, N] input, rows x_row_stride apart
    w_ptr,  # *Tw [N] weight
    rstd_ptr,  # *fp32 [M] out: 1 / sqrt(mean(x^2) + eps), saved for backward
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
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # [BLOCK_M]
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + rows64 * y_row_stride + cols[None, :], round_to(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def rms_norm_backward_kernel(
    dx_ptr,  # *T [M, N] out: gradient of x
    dy_ptr,  # *T [M, N] gradient of y
    x_ptr,  # *T [M, N] forward input
    w_ptr,  # *Tw [N] weight
    rstd_ptr,  # *fp32 [M] saved by the forward
    dw_partial_ptr,  # *fp32 [P, N] out: this program's sum over its rows of dy * x_hat (if WEIGHT_GRAD)
    dx_row_stride,
    dy_row_stride,
    x_row_stride,
    n_rows,
    n_cols,
    WEIGHT_GRAD: tl.constexpr,  # False: w is frozen, dw_partial_ptr is neither read nor written
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Persistent: P programs stride over the row blocks, each keeping its dw partial in registers.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        x_hat = x * rstd[:, None]
        wdy = dy * w[None, :]
        # dx = rstd * (w*dy - x_hat * mean(w*dy*x_hat)): the projection out of the x direction
        c = tl.sum(wdy * x_hat, axis=1) / n_cols
        dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows64 * dx_row_stride + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            dw += tl.sum(dy * x_hat, axis=0)
    if WEIGHT_GRAD:
        tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_mask)


def rms_norm_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y [..., N] in x.dtype and rstd [M] fp32 for x [..., N], w [N]."""
    shape = x.shape
    x2 = as_rows(x)
    n_rows, n_cols = x2.shape
    y = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = outputs.empty((n_rows,), dtype=torch.float32, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    rms_norm_forward_kernel[(triton.cdiv(n_rows, block_m),)](
        y, x2, w, rstd, y.stride(0), x2.stride(0), n_rows, n_cols, eps,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return y.view(shape), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                      weight_grad: bool = True):
    """(dx [..., N] in x.dtype, dw [N] in w.dtype); weight_grad=False (w frozen): (dx, None)."""
    shape = x.shape
    x2, dy2 = as_rows(x), as_rows(dy)
    n_rows, n_cols = x2.shape
    dx = outputs.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    block_m, block_n, num_warps = row_tile(n_rows, n_cols)
    programs = persistent_programs(x.device, triton.cdiv(n_rows, block_m))
    dw_partial = torch.empty((programs if weight_grad else 0, n_cols), dtype=torch.float32, device=x.device)
    rms_norm_backward_kernel[(programs,)](
        dx, dy2, x2, w, rstd, dw_partial, dx.stride(0), dy2.stride(0), x2.stride(0), n_rows, n_cols,
        WEIGHT_GRAD=weight_grad, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    if not weight_grad:
        return dx.view(shape), None
    dw = outputs.empty((n_cols,), dtype=w.dtype, device=w.device)
    return dx.view(shape), dw.copy_(dw_partial.sum(0))


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, rstd = rms_norm_forward(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, w, rstd, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused RMSNorm over the last dim of x; differentiable in x and w."""
    return RMSNormFunction.apply(x, w, eps)
