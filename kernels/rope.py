"""Rotary position embedding as Llama, Qwen2 and Mistral apply it (the rotate_half convention):
    y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
for q [B, Hq, S, D] and k [B, Hkv, S, D] (any strides with a unit stride on D, e.g. the transposed
view HF makes) and cos, sin of shape [S, D], [B, S, D] or [B, 1, S, D].

The backward is the same kernel rotating by -theta. The first and second halves of cos and sin are
read separately, so tables whose halves differ (not only HF's cat(freqs, freqs)) are handled exactly.
Computed in fp32, stored in x.dtype. For x of n elements of b bytes: reads n*b + the cos and sin
rows (once per head, from L2 after the first), writes n*b; eager PyTorch makes four full passes
(x*cos, rotate_half, *sin, +) with their intermediates.
cos and sin get no gradient: they are functions of the positions, not of parameters.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .tiling import TILE
from . import outputs


@triton.jit
def rope_kernel(
    y_ptr,  # *T [B, H, S, D] out: the rotated x
    x_ptr,  # *T [B, H, S, D] input (q or k; in the backward, the gradient of the output)
    cos_ptr,  # *Tc [B, S, D] (batch stride may be 0 for a table shared by the batch)
    sin_ptr,  # *Tc [B, S, D] same strides as cos
    y_stride_b, y_stride_h, y_stride_s,
    x_stride_b, x_stride_h, x_stride_s,
    cs_stride_b, cs_stride_s,
    n_heads,
    seq_len,
    HALF: tl.constexpr,  # D / 2
    BLOCK_S: tl.constexpr,  # sequence positions per program
    BLOCK_HALF: tl.constexpr,  # next power of two >= HALF
    BACKWARD: tl.constexpr,  # rotate by -theta (the gradient of the forward rotation)
):
    bh = tl.program_id(0)
    b = bh // n_heads
    h = bh % n_heads
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_HALF)
    mask = (s < seq_len)[:, None] & (d < HALF)[None, :]
    s64 = s.to(tl.int64)[:, None]

    x_row = x_ptr + b.to(tl.int64) * x_stride_b + h.to(tl.int64) * x_stride_h + s64 * x_stride_s + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    cs = b.to(tl.int64) * cs_stride_b + s64 * cs_stride_s + d[None, :]
    cos1 = tl.load(cos_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; its transpose: dx1 = dy1 c1 + dy2 s2,
        # dx2 = dy2 c2 - dy1 s1, which is the same formula with (s1, s2) -> (-s2, -s1)
        sin1, sin2 = -sin2, -sin1
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2

    y_row = y_ptr + b.to(tl.int64) * y_stride_b + h.to(tl.int64) * y_stride_h + s64 * y_stride_s + d[None, :]
    tl.store(y_row, round_to(y1, y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + HALF, round_to(y2, y_ptr.dtype.element_ty), mask=mask)


def _table(t: torch.Tensor, batch: int, seq_len: int, head_dim: int) -> torch.Tensor:
    """cos or sin as [B, S, D] (possibly a stride-0 batch view) with a unit stride on D."""
    if t.dim() == 4:
        assert t.shape[1] == 1, f"a 4-d cos/sin must be [B, 1, S, D], got {tuple(t.shape)}"
        t = t[:, 0]
    if t.dim() == 2:
        t = t.unsqueeze(0)
    assert t.shape[-2:] == (seq_len, head_dim), f"cos/sin {tuple(t.shape)} do not match S={seq_len}, D={head_dim}"
    t = t.expand(batch, seq_len, head_dim)
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """Rotate x [B, H, S, D] by the angles in cos, sin (by their negatives when backward)."""
    assert x.dim() == 4, f"x must be [B, H, S, D], got {tuple(x.shape)}"
    batch, n_heads, seq_len, head_dim = x.shape
    assert head_dim % 2 == 0, f"head_dim must be even, got {head_dim}"
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = _table(cos, batch, seq_len, head_dim), _table(sin, batch, seq_len, head_dim)
    assert cos.stride() == sin.stride(), "cos and sin must have the same layout"
    y = outputs.empty_like(x)
    if y.stride(-1) != 1:  # empty_like keeps a dense permuted layout; anything else is made contiguous
        y = outputs.empty(x.shape, dtype=x.dtype, device=x.device)
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_s = max(1, min(TILE // (2 * block_half), triton.next_power_of_2(seq_len)))
    num_warps = max(4, min(16, 2 * block_s * block_half // 1024))
    grid = (batch * n_heads, triton.cdiv(seq_len, block_s))
    rope_kernel[grid](
        y, x, cos, sin,
        y.stride(0), y.stride(1), y.stride(2),
        x.stride(0), x.stride(1), x.stride(2),
        cos.stride(0), cos.stride(1),
        n_heads, seq_len,
        HALF=half, BLOCK_S=block_s, BLOCK_HALF=block_half, BACKWARD=backward, num_warps=num_warps,
    )
    return y


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return rope_rotate(dq, cos, sin, backward=True), rope_rotate(dk, cos, sin, backward=True), None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed) as HF's apply_rotary_pos_emb returns them; differentiable in q and k."""
    return RoPEFunction.apply(q, k, cos, sin)
