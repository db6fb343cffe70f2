"""AdamW on the device for parameters kept resident: one pass updates the fp32 master, m and v in
place and can write a bf16 copy of the new master for the next forward.

Same arithmetic as torch.optim.AdamW (decoupled weight decay, bias correction, no amsgrad):
    p <- p * (1 - lr * wd)
    m <- lerp(m, g, 1 - beta1)
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
Per parameter: reads 12 B (p, m, v) + 4 B (fp32 g) or 2 B (bf16 g), writes 12 B (+2 B for the
bf16 copy): 28-30 B, against ~3x that for the unfused eager update.
The scalars (1 - lr * wd, 1 - beta, the bias corrections) are computed on the host in double
precision and rounded once to fp32, as torch does.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import flat_block


@triton.jit
def adamw_kernel(
    p_ptr,  # *fp32 [n] master weights, updated in place
    g_ptr,  # *fp32 or *bf16 [n] gradient
    m_ptr,  # *fp32 [n] first moment, updated in place
    v_ptr,  # *fp32 [n] second moment, updated in place
    out_ptr,  # *bf16 [n] out: the new master rounded to nearest even (not written unless WRITE_OUT)
    n,
    decay,  # 1 - lr * weight_decay
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    step_size,  # lr / (1 - beta1^t)
    bias_correction2_sqrt,  # sqrt(1 - beta2^t)
    WRITE_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    # IEEE-rounded division and square root (tl.sqrt and `/` compile to approximations on sm_80+)
    # and no contraction (launched with enable_fp_fusion=False): a fused multiply-add only where
    # torch rounds once, as the host kernel does (csrc/fused_adamw.cpp).
    p = p * decay
    m = tl.fma(one_minus_beta1, g - m, m)  # torch's lerp for a weight < 0.5
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # addcmul
    denom = tl.math.div_rn(tl.math.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.math.div_rn(m, denom)

    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WRITE_OUT:
        tl.store(out_ptr + offs, round_to(p, out_ptr.dtype.element_ty), mask=mask)


def adamw_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    out: torch.Tensor | None = None,
) -> None:
    """One AdamW update of p, m, v in place (step counts from 1); writes p's new value to out if given."""
    for name, t in (("p", p), ("m", m), ("v", v)):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name} must be contiguous fp32"
    assert g.shape == p.shape and m.shape == p.shape and v.shape == p.shape, "p, g, m, v must share a shape"
    assert step >= 1, f"step counts from 1, got {step}"
    g = g.contiguous()
    if out is not None:
        assert out.is_contiguous() and out.shape == p.shape, "out must be contiguous and shaped like p"
    beta1, beta2 = betas
    step_size = lr / (1.0 - beta1**step)
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    n = p.numel()
    if n == 0:
        return
    block, num_warps = flat_block(n)
    adamw_kernel[(triton.cdiv(n, block),)](
        p, g, m, v, out if out is not None else p, n,
        1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps, step_size, bias_correction2_sqrt,
        WRITE_OUT=out is not None, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False,
    )


def adamw_step_all_(params, grads, exp_avgs, exp_avg_sqs, *, step: int, outs=None, **hyper) -> None:
    """adamw_step_ over matching lists (one launch per tensor); outs may hold None entries."""
    outs = outs if outs is not None else [None] * len(params)
    for p, g, m, v, out in zip(params, grads, exp_avgs, exp_avg_sqs, outs, strict=True):
        adamw_step_(p, g, m, v, step=step, out=out, **hyper)
