"""SwiGLU gating as Llama/Qwen2/Mistral MLPs use it: c = silu(a) * b, with a = gate and b = up.

Computed in fp32, stored in the input dtype. For n elements of b bytes each:
  forward  reads 2*n*b (a, b), writes n*b (c);
  backward reads 3*n*b (dc, a, b), writes 2*n*b (da, db), recomputing sigmoid(a) instead of saving it.
Eager PyTorch writes and rereads silu(a) in the forward and saves it for the backward.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import flat_block
from . import outputs


@triton.jit
def swiglu_forward_kernel(
    c_ptr,  # *T [n] out: silu(a) * b
    a_ptr,  # *T [n] gate
    b_ptr,  # *T [n] up
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    c = a * tl.sigmoid(a) * b
    tl.store(c_ptr + offs, round_to(c, c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(
    da_ptr,  # *T [n] out: dc * b * silu'(a)
    db_ptr,  # *T [n] out: dc * silu(a)
    dc_ptr,  # *T [n] gradient of c
    a_ptr,  # *T [n] gate
    b_ptr,  # *T [n] up
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dc = tl.load(dc_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    # silu'(a) = sig + a * sig * (1 - sig)
    da = dc * b * (sig + silu * (1.0 - sig))
    db = dc * silu
    tl.store(da_ptr + offs, round_to(da, da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, round_to(db, db_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.shape == b.shape, f"gate {tuple(a.shape)} and up {tuple(b.shape)} differ"
    a, b = a.contiguous(), b.contiguous()
    c = outputs.empty_like(a)
    n = a.numel()
    if n:
        block, num_warps = flat_block(n)
        swiglu_forward_kernel[(triton.cdiv(n, block),)](c, a, b, n, BLOCK=block, num_warps=num_warps)
    return c


def swiglu_backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dc, a, b = dc.contiguous(), a.contiguous(), b.contiguous()
    da, db = outputs.empty_like(a), outputs.empty_like(b)
    n = a.numel()
    if n:
        block, num_warps = flat_block(n)
        swiglu_backward_kernel[(triton.cdiv(n, block),)](da, db, dc, a, b, n, BLOCK=block, num_warps=num_warps)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return swiglu_forward(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        return swiglu_backward(dc, a, b)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for gate a and up b of one shape; differentiable in both."""
    return SwiGLUFunction.apply(a, b)
