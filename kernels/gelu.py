"""GELU, plain (gelu(a)) or fused with the gating multiply (gelu(a) * b, GeGLU), in the exact erf
form or the tanh approximation (GPT-2's "gelu_new", Gemma's "gelu_pytorch_tanh").

Computed in fp32, stored in the input dtype. For n elements of b bytes each:
  gated  forward reads 2*n*b, writes n*b;  backward reads 3*n*b, writes 2*n*b;
  plain  forward reads n*b,   writes n*b;  backward reads 2*n*b, writes n*b.
The tanh form is evaluated as a * sigmoid(2u), u = sqrt(2/pi) * (a + 0.044715 a^3), which equals
0.5 * a * (1 + tanh(u)) exactly and needs no tanh (libdevice is unavailable under the interpreter);
erf comes from tl.math.erf, which works under the interpreter and lowers to the GPU's erff.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import flat_block
from . import outputs

TWO_SQRT_2_OVER_PI = tl.constexpr(2 * 0.7978845608028654)  # 2 * sqrt(2 / pi)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's `approximate` values


@triton.jit
def _gelu_and_slope(a, TANH: tl.constexpr):
    """(gelu(a), d gelu / d a) in fp32."""
    if TANH:
        a2 = a * a
        # constants on the right: the interpreter cannot multiply a constexpr by a tensor
        s = tl.sigmoid((a + 0.044715 * a2 * a) * TWO_SQRT_2_OVER_PI)  # = (1 + tanh(u)) / 2
        g = a * s
        slope = s + g * (1.0 - s) * ((1.0 + 3.0 * 0.044715 * a2) * TWO_SQRT_2_OVER_PI)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(a * INV_SQRT_2))
        g = a * cdf
        slope = cdf + a * INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    return g, slope


@triton.jit
def gelu_forward_kernel(
    c_ptr,  # *T [n] out: gelu(a) * b, or gelu(a) when not GATED
    a_ptr,  # *T [n] input of the gelu
    b_ptr,  # *T [n] gating multiplier (not read when not GATED)
    n,
    GATED: tl.constexpr,
    TANH: tl.constexpr,  # tanh approximation instead of erf
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c, _ = _gelu_and_slope(a, TANH)
    if GATED:
        c = c * tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, round_to(c, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_backward_kernel(
    da_ptr,  # *T [n] out: dc * b * gelu'(a)  (dc * gelu'(a) when not GATED)
    db_ptr,  # *T [n] out: dc * gelu(a) (not written when not GATED)
    dc_ptr,  # *T [n] gradient of c
    a_ptr,  # *T [n] input of the gelu
    b_ptr,  # *T [n] gating multiplier (not read when not GATED)
    n,
    GATED: tl.constexpr,
    TANH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(dc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g, slope = _gelu_and_slope(a, TANH)
    if GATED:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(db_ptr + offs, round_to(dc * g, db_ptr.dtype.element_ty), mask=mask)
        dc = dc * b
    tl.store(da_ptr + offs, round_to(dc * slope, da_ptr.dtype.element_ty), mask=mask)


def _check(approximate: str) -> bool:
    assert approximate in APPROXIMATIONS, f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}"
    return approximate == "tanh"


def gelu_forward(a: torch.Tensor, b: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """gelu(a) * b, or gelu(a) when b is None."""
    tanh = _check(approximate)
    gated = b is not None
    assert not gated or a.shape == b.shape, f"a {tuple(a.shape)} and b {tuple(b.shape)} differ"
    a = a.contiguous()
    b = b.contiguous() if gated else a
    c = outputs.empty_like(a)
    n = a.numel()
    if n:
        block, num_warps = flat_block(n)
        gelu_forward_kernel[(triton.cdiv(n, block),)](
            c, a, b, n, GATED=gated, TANH=tanh, BLOCK=block, num_warps=num_warps
        )
    return c


def gelu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None = None, approximate: str = "none"):
    """(da, db); db is None when b is None."""
    tanh = _check(approximate)
    gated = b is not None
    dc, a = dc.contiguous(), a.contiguous()
    b = b.contiguous() if gated else a
    da = outputs.empty_like(a)
    db = outputs.empty_like(b) if gated else da  # not written when not gated
    n = a.numel()
    if n:
        block, num_warps = flat_block(n)
        gelu_backward_kernel[(triton.cdiv(n, block),)](
            da, db, dc, a, b, n, GATED=gated, TANH=tanh, BLOCK=block, num_warps=num_warps
        )
    return da, (db if gated else None)


class GELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, approximate):
        ctx.save_for_backward(a, b)
        ctx.approximate = approximate
        return gelu_forward(a, b, approximate)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da, db = gelu_backward(dc, a, b, ctx.approximate)
        return da, db, None


def gelu(a: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """torch.nn.functional.gelu(a, approximate=...), fused; differentiable in a."""
    return GELUFunction.apply(a, None, approximate)


def geglu(a: torch.Tensor, b: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(a) * b, fused; differentiable in a and b."""
    return GELUFunction.apply(a, b, approximate)
